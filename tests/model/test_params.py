"""PET's initialisation: the statistics of every parameter tree entry (embeddings
N(0, 1), linear layers U(-1/sqrt(fan_in), 1/sqrt(fan_in)), norms 1 and 0), and its own
random generator."""

import math

import torch

import petfunc


SMALL = dict(atomic_types=(1, 6, 7, 8), d_pet=8, d_node=16, d_head=8, d_feedforward=16, num_heads=2)
F64 = torch.float64
CONFIG = petfunc.PETConfig(**SMALL)


def _is_embedding(name):
    return name == "edge_embedder.weight" or name.startswith("node_embedders.") or "neighbor_embedder" in name


def test_init_statistics():
    config = petfunc.PETConfig()  # the default architecture: large tensors, tight stats
    flat = petfunc.tree.flatten(petfunc.PET(config).init(seed=3, dtype=F64))
    embeddings = torch.cat([v.reshape(-1) for k, v in flat.items() if _is_embedding(k)])
    assert embeddings.numel() >= 2000
    assert abs(float(embeddings.mean())) < 0.06 and abs(float(embeddings.std()) - 1) < 0.06
    checked = 0
    for name, value in flat.items():
        if "norm" in name:
            expected = 1.0 if name.endswith("weight") else 0.0
            assert torch.all(value == expected), name
        elif name.endswith(".weight") and not _is_embedding(name):
            fan_in = value.shape[1]
            bound = 1 / math.sqrt(fan_in)
            bias = flat.get(name[: -len("weight")] + "bias")
            for tensor in (value, bias) if bias is not None else (value,):
                assert float(tensor.abs().max()) <= bound, name
                if tensor.numel() >= 10000:  # U(-b, b): mean 0, std b / sqrt(3)
                    assert abs(float(tensor.mean())) < 0.03 * bound, name
                    assert abs(float(tensor.std()) / (bound / math.sqrt(3)) - 1) < 0.03, name
                    checked += 1
    assert checked >= 20
    assert torch.all(flat["composition_weights"] == 0) and float(flat["energy_scale"]) == 1.0


def test_init_uses_its_own_generator():
    state = torch.random.get_rng_state()
    a = petfunc.PET(CONFIG).init(seed=7)
    assert torch.equal(torch.random.get_rng_state(), state)
    b = petfunc.PET(CONFIG).init(seed=7)
    c = petfunc.PET(CONFIG).init(seed=8)
    d = petfunc.PET(CONFIG).init(generator=torch.Generator().manual_seed(7))
    fa, fb, fc, fd = (petfunc.tree.flatten(t) for t in (a, b, c, d))
    assert all(torch.equal(fa[k], fb[k]) and torch.equal(fa[k], fd[k]) for k in fa)
    assert not torch.equal(fa["gnn_layers.0.compress.0.weight"], fc["gnn_layers.0.compress.0.weight"])
    # float32 and float64 draws are the same numbers, rounded
    a64 = petfunc.tree.flatten(petfunc.PET(CONFIG).init(seed=7, dtype=F64))
    assert all(torch.equal(a64[k].float(), fa[k]) for k in fa)
