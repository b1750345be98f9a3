"""Fine-tuning steps equal metatrain's (its ``finetune: {method: heads}`` and
``{method: lora}``).

* One optimizer step with ``train=HEADS`` equals metatrain's: its
  ``apply_finetuning_strategy`` freezes everything but the heads and last layers,
  ``clip_grad_norm_`` sees the trained gradients only and ``torch.optim.Adam`` steps
  them (float64, 1e-10; clipping active).
* LoRA: with metatrain's adapter weights copied in, one step equals metatrain's
  (loss, clipped norm, adapter updates; the rest frozen); on a LoRA checkpoint,
  metatrain and ``petfunc train`` train its own adapters on.
"""

import ase
import numpy as np
import pytest
import torch

import petfunc
from petfunc import lora, tree
from petfunc.data import make_batch, sample_from_atoms
from petfunc.io import load_model
from petfunc.train import HEADS
from petfunc.trainer import fit


try:  # the metatrain comparisons need the test extra
    from tests.helpers import mtt_reference as ref
except ImportError:
    ref = None

needs_metatrain = pytest.mark.skipif(ref is None, reason="metatrain (the test extra) is not installed")


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


def _batch_and_labels():
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
    batch = make_batch(
        samples, CONFIG, params["composition_weights"].numpy(), 1.0, dtype=torch.float64, pad=False
    )
    return frames, params, batch


WEIGHTS = petfunc.LossWeights.make(energy=1.0, forces=1.0, stress=0.0)
CLIP, LR = 0.05, 1e-3  # a small norm, so that clipping is active


def _metatrain_step(model, frames, batch):
    """metatrain's trainer step on ``model`` (frozen parameters already set): the
    energy + forces loss, ``clip_grad_norm_`` and Adam. Returns (loss, norm)."""
    from metatomic.torch import systems_to_torch
    from metatrain.utils.data.target_info import get_energy_target_info
    from metatrain.utils.evaluate_model import evaluate_model
    from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

    model.train()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    systems = [
        get_system_with_neighbor_lists(s, model.requested_neighbor_lists())
        for s in systems_to_torch(frames, dtype=torch.float64)
    ]
    info = get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"}, add_position_gradients=True)
    out = evaluate_model(model, systems, {"energy": info}, is_training=True)["energy"].block()
    n = torch.tensor([len(a) for a in frames], dtype=torch.float64)
    loss = ((out.values[:, 0] - batch.energy) / n).pow(2).mean() + (
        out.gradient("positions").values[:, :, 0] + batch.forces
    ).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    optimizer.step()
    return loss, norm


def _compare_updates(model, before, after, metrics, loss, norm):
    """Trained parameters moved as metatrain's did, frozen ones did not move."""
    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * loss.item()
    assert abs(norm.item() - metrics["grad_norm"].item()) <= 1e-10 * norm.item()
    moved = 0
    for name, parameter in model.named_parameters():
        key = (
            name.removeprefix("backend.")
            .replace(".linear.weight", ".weight")
            .replace(".linear.bias", ".bias")
        )
        if ".lora_" in key:
            key = "lora." + key
        if parameter.requires_grad:
            update = parameter.detach() - before[key]
            torch.testing.assert_close(after[key] - before[key], update, rtol=1e-10, atol=1e-14, msg=key)
            moved += bool(update.abs().max() > 0)
        else:
            assert torch.equal(after[key], before[key]), key
    return moved


@needs_metatrain
def test_heads_step_equals_metatrain():
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy

    frames, params, batch = _batch_and_labels()
    optimizer = petfunc.make_optimizer(LR)
    state = petfunc.init_state(params, optimizer, HEADS)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, WEIGHTS, CLIP, train=HEADS)
    new_state, metrics = step(state, batch)
    assert float(metrics["grad_norm"]) > CLIP
    assert set(state.opt_state.mu) == {k for k in tree.flatten(params) if k.startswith(HEADS)}
    # the data-parallel step (one process here) takes the same selection
    from petfunc.distributed import DataParallel

    dp_state, _ = DataParallel(petfunc.PET(CONFIG), optimizer, WEIGHTS, CLIP, train=HEADS).step(state, batch)
    for key, value in tree.flatten(dp_state.params).items():
        torch.testing.assert_close(
            value, tree.flatten(new_state.params)[key], rtol=1e-12, atol=1e-15, msg=key
        )

    model = ref.make_model(CONFIG)
    ref.load_params(model, params)
    model = apply_finetuning_strategy(
        model,
        {
            "method": "heads",
            "read_from": "-",
            "inherit_heads": {},
            "config": {
                "head_modules": ["node_heads", "edge_heads"],
                "last_layer_modules": ["node_last_layers", "edge_last_layers"],
            },
        },
    )
    loss, norm = _metatrain_step(model, frames, batch)
    moved = _compare_updates(model, tree.flatten(params), tree.flatten(new_state.params), metrics, loss, norm)
    assert moved >= 8


@needs_metatrain
@pytest.mark.parametrize("targets", [None, ["w_in", "edge_embedder"]])
def test_lora_step_equals_metatrain(targets):
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy

    frames, params, batch = _batch_and_labels()
    rank, alpha = 3, 5.0
    model = ref.make_model(CONFIG)
    ref.load_params(model, params)
    config = {"rank": rank, "alpha": alpha, **({"target_modules": targets} if targets else {})}
    torch.manual_seed(0)
    model = apply_finetuning_strategy(
        model, {"method": "lora", "read_from": "-", "inherit_heads": {}, "config": config}
    )
    # metatrain draws B like any nn.Linear weight (not zero), so the adapters change
    # the energy from the start: copy its adapter weights
    params = lora.attach(params, rank, tuple(targets or lora.DEFAULT_TARGETS))
    adapters = {
        "lora." + k.removeprefix("backend."): v.detach().clone()
        for k, v in model.state_dict().items()
        if ".lora_" in k
    }
    assert set(adapters) == set(tree.flatten({"lora": params["lora"]})) and adapters
    params = {**params, "lora": tree.unflatten({k.removeprefix("lora."): v for k, v in adapters.items()})}

    pet = lora.LoRAPET(CONFIG, alpha / rank)
    optimizer = petfunc.make_optimizer(LR)
    state = petfunc.init_state(params, optimizer, lora.TRAIN)
    new_state, metrics = petfunc.make_train_step(pet, optimizer, WEIGHTS, CLIP, train=lora.TRAIN)(
        state, batch
    )
    assert float(metrics["grad_norm"]) > CLIP
    loss, norm = _metatrain_step(model, frames, batch)
    moved = _compare_updates(model, tree.flatten(params), tree.flatten(new_state.params), metrics, loss, norm)
    assert moved == len(adapters)
    # the merged parameters are a plain PET with the adapted function
    merged = lora.merge(params, alpha / rank)
    positions, cell, neighbors = batch.positions, batch.cell, batch.neighbors
    torch.testing.assert_close(
        petfunc.PET(CONFIG).energy(merged, positions, cell, neighbors),
        pet.energy(params, positions, cell, neighbors),
        rtol=1e-13,
        atol=0.0,
    )


@needs_metatrain
def test_lora_on_a_lora_checkpoint_trains_its_adapters_on(tmp_path):
    """metatrain's apply_finetuning_strategy injects no adapters into a model that has
    some: ``method: lora`` on a metatrain LoRA checkpoint trains the source's adapters
    on, with the source's rank and alpha. petfunc keeps them apart (not merged), and
    its step equals metatrain's."""
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy
    from metatrain.utils.io import model_from_checkpoint

    from petfunc.io.load import load_model_and_lora

    frames, params, batch = _batch_and_labels()
    model = ref.make_model(CONFIG)
    ref.load_params(model, params)
    strategy = {"method": "lora", "read_from": "-", "inherit_heads": {}, "config": {"rank": 2, "alpha": 3.0}}
    torch.manual_seed(0)
    model = apply_finetuning_strategy(model, strategy)
    checkpoint = model.get_checkpoint()
    checkpoint["best_model_state_dict"]["finetune_config"] = strategy  # as metatrain's trainer does
    path = tmp_path / "lora.ckpt"
    torch.save(checkpoint, path)

    config, start, source = load_model_and_lora(path, torch.float64, "best", None, None, keep_lora=True)
    assert source == {"rank": 2, "alpha": 3.0, "targets": lora.DEFAULT_TARGETS}
    flat = tree.flatten(start)
    wrapped = [k for k in model.state_dict() if ".lora_" in k or ".linear.weight" in k]
    assert len(wrapped) == 24  # 8 adapted linears (4 attention layers): base weight, A, B
    for key in wrapped:
        name = key.removeprefix("backend.").replace(".linear.weight", ".weight")
        assert torch.equal(
            flat["lora." + name if ".lora_" in key else name], model.state_dict()[key].double()
        ), key
    # the same function as the merged weights (which equal metatrain's, tests/io/metatrain/test_checkpoint.py)
    _, merged = load_model(path, dtype=torch.float64)
    positions, cell, neighbors = batch.positions, batch.cell, batch.neighbors
    torch.testing.assert_close(
        lora.LoRAPET(config, 3.0 / 2).energy(start, positions, cell, neighbors),
        petfunc.PET(config).energy(merged, positions, cell, neighbors),
        rtol=1e-13,
        atol=0.0,
    )

    # metatrain fine-tunes it again with other LoRA settings: no new adapters
    again = model_from_checkpoint(checkpoint, "finetune").to(torch.float64)
    again = apply_finetuning_strategy(again, {**strategy, "config": {"rank": 4, "alpha": 8.0}})
    assert sorted(k for k, p in again.named_parameters() if p.requires_grad) == sorted(
        k for k in model.state_dict() if ".lora_" in k
    )
    before = {k: v.clone() for k, v in flat.items()}
    start["composition_weights"] = params["composition_weights"]  # the batch's training units
    start["energy_scale"] = torch.ones((), dtype=torch.float64)
    optimizer = petfunc.make_optimizer(LR)
    state = petfunc.init_state(start, optimizer, lora.TRAIN)
    pet = lora.LoRAPET(config, source["alpha"] / source["rank"])
    new_state, metrics = petfunc.make_train_step(pet, optimizer, WEIGHTS, CLIP, train=lora.TRAIN)(
        state, batch
    )
    loss, norm = _metatrain_step(again, frames, batch)
    before["composition_weights"], before["energy_scale"] = (
        start["composition_weights"],
        start["energy_scale"],
    )
    moved = _compare_updates(again, before, tree.flatten(new_state.params), metrics, loss, norm)
    assert moved == 16

    # petfunc train does the same: the source's adapters, rank and alpha, not the options'
    import ase.io

    labels = np.random.default_rng(5)
    written = []
    for i in range(8):
        atoms = _frames()[i % 3].copy()
        atoms.rattle(0.02, seed=i)
        atoms.info["energy"] = float(labels.normal())
        atoms.arrays["forces"] = labels.normal(size=(len(atoms), 3))
        written.append(atoms)
    data = tmp_path / "hco.xyz"
    ase.io.write(data, written)
    lines = []
    options = {
        "seed": 2,
        "base_precision": 64,
        "training_set": str(data),
        "validation_set": 0.25,
        "architecture": {
            "name": "pet",
            "training": {
                "batch_size": 4,
                "num_epochs": 1,
                "atomic_baseline": {"energy": 0.0},
                "finetune": {"read_from": str(path), "method": "lora", "config": {"rank": 4, "alpha": 8}},
            },
        },
    }
    fit(options, tmp_path / "run", progress=False, log=lines.append)
    assert any("training them on (rank 2, alpha 3)" in m for m in lines), lines
    assert any("LoRA adapters of rank 2 (alpha 3) on 8 layers" in m for m in lines), lines
    last = torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)
    adapters = {k: v for k, v in last["params"].items() if k.startswith("lora.")}
    assert sorted(adapters) == sorted(k for k in flat if k.startswith("lora."))
    assert all(adapters[k].shape == flat[k].shape for k in adapters)
    assert all((adapters[k] - flat[k]).abs().max() < 1e-2 for k in adapters)  # one small step on
