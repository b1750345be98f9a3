"""Fine-tuning the readout only (metatrain's ``finetune: {method: heads}``).

* One optimizer step with ``train=HEADS`` equals metatrain's: its
  ``apply_finetuning_strategy`` freezes everything but the heads and last layers,
  ``clip_grad_norm_`` sees the trained gradients only and ``torch.optim.Adam`` steps
  them (float64, 1e-10; clipping active).
* ``petfunc train`` with ``method: heads`` leaves every other weight bit-identical to
  the model it read, moves the heads, and resumes exactly from a checkpoint.
* Bad ``finetune`` sections get clear errors.
"""

import ase
import numpy as np
import pytest
import torch

import petfunc
from petfunc import tree
from petfunc.cli import make_default_dataset
from petfunc.data import make_batch, sample_from_atoms

from petfunc.options import resolve_options, trained_parameters
from petfunc.train import HEADS, trainable
from petfunc.trainer import fit, load_model

import mtt_reference as ref


CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 8), d_pet=16, d_node=24, d_head=16, d_feedforward=32, num_heads=2, cutoff=4.0
)


def _frames():
    rng = np.random.default_rng(7)
    frames = []
    for i in range(3):
        numbers = rng.choice([1, 6, 8], size=5 + i)
        positions = rng.uniform(0.0, 3.0 + i, size=(len(numbers), 3))
        periodic = i == 1
        cell = np.diag([4.5, 4.8, 5.1]) if periodic else np.zeros((3, 3))
        frames.append(ase.Atoms(numbers=numbers, positions=positions, cell=cell, pbc=periodic))
    return frames


def test_heads_step_equals_metatrain():
    from metatomic.torch import systems_to_torch
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy
    from metatrain.utils.data.target_info import get_energy_target_info
    from metatrain.utils.evaluate_model import evaluate_model
    from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

    frames = _frames()
    params = petfunc.init(CONFIG, seed=4, dtype=torch.float64)
    params["composition_weights"] = torch.tensor([-1.0, -3.0, -5.0], dtype=torch.float64)
    labels = np.random.default_rng(3)
    samples = []
    for atoms in frames:
        s = sample_from_atoms(atoms, CONFIG, energy_key=None, forces_key=None, stress_key=None)
        s.energy = float(labels.normal())
        s.forces = labels.normal(size=(len(atoms), 3))
        samples.append(s)
    batch = make_batch(samples, CONFIG, params["composition_weights"].numpy(), 1.0, dtype=torch.float64, pad=False)
    weights = petfunc.LossWeights.make(energy=1.0, forces=1.0, stress=0.0)
    clip, lr = 0.05, 1e-3  # a small norm, so that clipping is active

    optimizer = petfunc.make_optimizer(lr)
    state = petfunc.init_state(params, optimizer, HEADS)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, weights, clip, train=HEADS)
    new_state, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) > clip
    assert set(state.opt_state.mu) == {k for k in tree.flatten(params) if k.startswith(HEADS)}
    # the data-parallel step (one process here) takes the same selection
    from petfunc.distributed import DataParallel

    dp_state, _ = DataParallel(petfunc.PET(CONFIG), optimizer, weights, clip, train=HEADS).step(state, batch)
    for key, value in tree.flatten(dp_state.params).items():
        torch.testing.assert_close(value, tree.flatten(new_state.params)[key], rtol=1e-12, atol=1e-15, msg=key)

    model = ref.make_model(CONFIG)
    ref.load_params(model, params)
    model = apply_finetuning_strategy(model, {"method": "heads", "read_from": "-", "inherit_heads": {}, "config": {
        "head_modules": ["node_heads", "edge_heads"], "last_layer_modules": ["node_last_layers", "edge_last_layers"],
    }})
    model.train()
    reference = torch.optim.Adam(model.parameters(), lr=lr)
    systems = [get_system_with_neighbor_lists(s, model.requested_neighbor_lists())
               for s in systems_to_torch(frames, dtype=torch.float64)]
    info = get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"}, add_position_gradients=True)
    out = evaluate_model(model, systems, {"energy": info}, is_training=True)["energy"].block()
    n = torch.tensor([len(a) for a in frames], dtype=torch.float64)
    loss = ((out.values[:, 0] - batch.energy) / n).pow(2).mean() + (
        out.gradient("positions").values[:, :, 0] + batch.forces).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    reference.step()

    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * loss.item()
    assert abs(norm.item() - metrics["grad_norm"].item()) <= 1e-10 * norm.item()
    ours, before = tree.flatten(new_state.params), tree.flatten(params)
    moved = 0
    for name, parameter in model.named_parameters():
        key = name.removeprefix("backend.")
        if parameter.requires_grad:
            update = parameter.detach() - before[key]
            torch.testing.assert_close(ours[key] - before[key], update, rtol=1e-10, atol=1e-14, msg=key)
            moved += bool(update.abs().max() > 0)
        else:
            assert torch.equal(ours[key], before[key]), key
    assert moved >= 8


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model trained from scratch, and the dataset it was trained on."""
    folder = tmp_path_factory.mktemp("heads")
    data = make_default_dataset(folder / "emt.xyz", n_structures=12, seed=2)
    options = {
        "seed": 1,
        "base_precision": 64,
        "architecture": {"name": "pet", "model": {"d_pet": 8, "d_node": 8, "d_head": 8, "d_feedforward": 8,
                                                  "num_heads": 2, "num_gnn_layers": 1},
                         "training": {"batch_size": 4, "num_epochs": 1}},
        "training_set": str(data),
        "validation_set": 0.25,
    }
    fit(options, folder / "base", progress=False, log=lambda m: None)
    return data, folder / "base" / "best.ckpt"


def _heads_options(data, checkpoint, **finetune):
    return {
        "seed": 2,
        "base_precision": 64,
        "architecture": {"name": "pet", "training": {
            "batch_size": 4, "num_epochs": 3, "learning_rate": 1e-2, "checkpoint_interval": 1,
            "finetune": {"read_from": str(checkpoint), "method": "heads", **finetune}}},
        "training_set": str(data),
        "validation_set": 0.25,
    }


def test_heads_finetuning_trains_only_the_heads_and_resumes(base, tmp_path):
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    lines = []
    result = fit(_heads_options(data, checkpoint), tmp_path / "run", progress=False, log=lines.append)
    assert any("fine-tuning node_heads, edge_heads, node_last_layers, edge_last_layers only" in m for m in lines)
    before, after = tree.flatten(trainable(start)), tree.flatten(result.last_params)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(k.startswith(HEADS) for k in moved), moved
    assert len(moved) == len([k for k in before if k.startswith(HEADS)])
    # resuming from epoch 1 gives the uninterrupted run's weights, bit for bit
    resumed = fit(None, tmp_path / "resumed", restart=tmp_path / "run" / "epoch_1.ckpt", progress=False,
                  log=lambda m: None)
    a, b = tree.flatten(result.last_params), tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_heads_selection_from_options(base, tmp_path):
    data, checkpoint = base
    custom = {"config": {"head_modules": ["backend.node_heads"], "last_layer_modules": ["node_last_layers"]}}
    options = resolve_options(_heads_options(data, checkpoint, **custom))
    assert trained_parameters(options["architecture"]["training"]["finetune"]) == ("node_heads", "node_last_layers")
    default = resolve_options(_heads_options(data, checkpoint))
    assert trained_parameters(default["architecture"]["training"]["finetune"]) == HEADS


@pytest.mark.parametrize("finetune, match", [
    ({"method": "lora"}, r"must be 'full' or 'heads', got 'lora' \(LoRA-fine-tuned metatrain checkpoints load"),
    ({"config": {"head_module": ["node_heads"]}}, r"finetune.config.head_module' .*did you mean 'head_modules'"),
    ({"config": {"head_modules": "node_heads"}}, r"must be a list of module names"),
    ({"inherit_heads": {"energy2": "energy"}}, r"inherit_heads' is not supported"),
    ({"read_from": None}, r"method: heads' needs .*finetune.read_from"),
])
def test_bad_finetune_sections(base, finetune, match):
    data, checkpoint = base
    with pytest.raises(ValueError, match=match):
        resolve_options(_heads_options(data, checkpoint, **finetune))


def test_heads_that_match_nothing(base, tmp_path):
    data, checkpoint = base
    options = _heads_options(data, checkpoint, config={"head_modules": ["readout"], "last_layer_modules": []})
    with pytest.raises(ValueError, match=r"no parameter path starts with any of \['readout'\]"):
        fit(options, tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run" / "last.ckpt").exists()
