"""PET's initialisation: the statistics of every parameter tree entry (embeddings
N(0, 1), linear layers U(-1/sqrt(fan_in), 1/sqrt(fan_in)), norms 1 and 0), and its own
random generator."""

import math

import pytest
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


def test_check_params_names_the_mismatch():
    """petfunc.check_params names what the energy would fail on with a bare KeyError or
    a matmul's size error: a missing, unexpected or misshapen weight, mixed network
    dtypes, a tensor on another device."""
    params = petfunc.init(CONFIG)
    petfunc.check_params(CONFIG, params)
    # the composition weights and energy scale may be float64 in a float32 model
    petfunc.check_params(CONFIG, {**params, "composition_weights": params["composition_weights"].double()})

    def mutated(key, value):
        flat = petfunc.tree.flatten(petfunc.init(CONFIG))
        if value is None:
            del flat[key]
        else:
            flat[key] = value
        return petfunc.tree.unflatten(flat)

    cases = [
        ("edge_embedder.weight", None, r"missing \['edge_embedder.weight'\]"),
        ("gnn_layers.0.extra.weight", torch.zeros(2), r"unexpected \['gnn_layers.0.extra.weight'\]"),
        (
            "gnn_layers.0.compress.0.weight",
            torch.zeros(3, 3),
            r"compress.0.weight has shape \[3, 3\], expected \[8, 16\]",
        ),
        (
            "node_embedders.0.weight",
            torch.zeros(4, 16, dtype=torch.int64),
            r"has dtype torch.int64, expected a floating",
        ),
        (
            "gnn_layers.1.compress.0.weight",
            torch.zeros(8, 24, dtype=F64),
            r"gnn_layers.1.compress.0.weight is torch.float64 but gnn_layers.0.\S+ is torch.float32",
        ),
        (
            "energy_scale",
            torch.ones((), device="meta"),
            r"energy_scale is on meta but gnn_layers.0.\S+ on cpu",
        ),
    ]
    for key, value, message in cases:
        with pytest.raises(ValueError, match=r"parameters do not match the config: .*" + message):
            petfunc.check_params(CONFIG, mutated(key, value))
    # the parameters of another architecture: the keys are listed, the first few only
    other = petfunc.init(petfunc.PETConfig(**{**SMALL, "num_gnn_layers": 4}))
    with pytest.raises(
        ValueError, match=r"unexpected \['gnn_layers.2.[^]]*\] and \d+ more.*petfunc.init\(config\)"
    ):
        petfunc.check_params(CONFIG, other)
    with pytest.raises(ValueError, match="must be a nested dict of tensors, as petfunc.init"):
        petfunc.check_params(CONFIG, [params])
    with pytest.raises(TypeError, match="config must be a PETConfig, got dict"):
        petfunc.check_params(SMALL, params)
    # the loaders' check is the same function
    assert petfunc.io.check_params is petfunc.check_params
