"""Fine-tuning the readout only or low-rank adapters (metatrain's ``finetune:
{method: heads}`` and ``{method: lora}``).

* One optimizer step with ``train=HEADS`` equals metatrain's: its
  ``apply_finetuning_strategy`` freezes everything but the heads and last layers,
  ``clip_grad_norm_`` sees the trained gradients only and ``torch.optim.Adam`` steps
  them (float64, 1e-10; clipping active).
* ``petfunc train`` with ``method: heads`` leaves every other weight bit-identical to
  the model it read, moves the heads, and resumes exactly from a checkpoint.
* LoRA: with metatrain's adapter weights copied in, one step equals metatrain's
  (loss, clipped norm, adapter updates; the rest frozen); ``petfunc train`` with
  ``method: lora`` changes only the adapted layers of the merged model, writes plain
  parameters and resumes exactly.
* Bad ``finetune`` sections get clear errors.
"""

import json

import ase
import numpy as np
import pytest
import torch

import petfunc
from petfunc import lora, tree
from petfunc.cli.commands import make_default_dataset
from petfunc.data import make_batch, sample_from_atoms
from petfunc.train import HEADS, trainable
from petfunc.io import load_model
from petfunc.trainer.training import fit
from petfunc.trainer.options import resolve_options, trained_parameters


try:  # the metatrain comparisons need the test extra
    from helpers import mtt_reference as ref
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
    # the same function as the merged weights (which equal metatrain's, tests/test_io.py)
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


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model trained from scratch, and the dataset it was trained on."""
    folder = tmp_path_factory.mktemp("heads")
    data = make_default_dataset(folder / "emt.xyz", n_structures=12, seed=2)
    options = {
        "seed": 1,
        "base_precision": 64,
        "architecture": {
            "name": "pet",
            "model": {
                "d_pet": 8,
                "d_node": 8,
                "d_head": 8,
                "d_feedforward": 8,
                "num_heads": 2,
                "num_gnn_layers": 1,
            },
            "training": {"batch_size": 4, "num_epochs": 1},
        },
        "training_set": str(data),
        "validation_set": 0.25,
    }
    fit(options, folder / "base", progress=False, log=lambda m: None)
    return data, folder / "base" / "best.ckpt"


def _heads_options(data, checkpoint, **finetune):
    return {
        "seed": 2,
        "base_precision": 64,
        "architecture": {
            "name": "pet",
            "training": {
                "batch_size": 4,
                "num_epochs": 3,
                "learning_rate": 1e-2,
                "checkpoint_interval": 1,
                "finetune": {"read_from": str(checkpoint), "method": "heads", **finetune},
            },
        },
        "training_set": str(data),
        "validation_set": 0.25,
    }


def test_heads_finetuning_trains_only_the_heads_and_resumes(base, tmp_path):
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    lines = []
    result = fit(_heads_options(data, checkpoint), tmp_path / "run", progress=False, log=lines.append)
    assert any(
        "fine-tuning node_heads, edge_heads, node_last_layers, edge_last_layers only" in m for m in lines
    )
    before, after = tree.flatten(trainable(start)), tree.flatten(result.last_params)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(k.startswith(HEADS) for k in moved), moved
    assert len(moved) == len([k for k in before if k.startswith(HEADS)])
    # resuming from epoch 1 gives the uninterrupted run's weights, bit for bit
    resumed = fit(
        None,
        tmp_path / "resumed",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lambda m: None,
    )
    a, b = tree.flatten(result.last_params), tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_finetuning_keeps_the_composition_and_scale(base, tmp_path):
    """metatrain fits the composition weights and energy scale only for a target new
    to the model: fine-tuning keeps the checkpoint's (petfunc refitted them, so a
    fine-tuned model did not start from the pretrained one: 0.4-0.9 eV per cell
    apart on the helpers' data). A weights dict in the options is not used then,
    as in metatrain."""
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    for method in ("heads", "full"):
        options = _heads_options(data, checkpoint, method=method)
        options["architecture"]["training"].update(num_epochs=1, atomic_baseline={"energy": 0.5})
        lines = []
        result = fit(options, tmp_path / method, progress=False, log=lines.append)
        for key in ("composition_weights", "energy_scale"):
            assert torch.equal(result.last_params[key], start[key]), key
        assert any(
            "composition weights of the fine-tuning checkpoint, energy scale of the fine-tuning checkpoint"
            in line
            and "atomic_baseline given as weights are not used" in line
            for line in lines
        ), lines
    # atomic types the options add to the checkpoint's were ignored; metatrain refuses them
    options = _heads_options(data, checkpoint)
    options["architecture"]["atomic_types"] = [1, 6, 7, 8, 29, 79]
    with pytest.raises(
        ValueError, match=r"'architecture.atomic_types' has type\(s\) \[.*79\] that the model of"
    ):
        fit(options, None, progress=False, log=lambda m: None)


def test_heads_selection_from_options(base, tmp_path):
    data, checkpoint = base
    custom = {"config": {"head_modules": ["backend.node_heads"], "last_layer_modules": ["node_last_layers"]}}
    options = resolve_options(_heads_options(data, checkpoint, **custom))
    assert trained_parameters(options["architecture"]["training"]["finetune"]) == (
        "node_heads",
        "node_last_layers",
    )
    default = resolve_options(_heads_options(data, checkpoint))
    assert trained_parameters(default["architecture"]["training"]["finetune"]) == HEADS


def test_lora_finetuning_writes_plain_models_and_resumes(base, tmp_path):
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    lines = []
    options = _heads_options(data, checkpoint, method="lora", config={"rank": 2, "alpha": 4})
    result = fit(options, tmp_path / "run", progress=False, log=lines.append)
    adapted = lora.target_layers(start)  # 2 attention layers, input and output linear
    assert len(adapted) == 4 and all(
        k.endswith(("attention.input_linear", "attention.output_linear")) for k in adapted
    )
    assert any("LoRA adapters of rank 2 (alpha 4) on 4 layers" in m for m in lines), lines
    assert "lora" not in result.last_params and "lora" not in result.params
    before, after = tree.flatten(trainable(start)), tree.flatten(result.last_params)
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert moved == sorted(f"{k}.weight" for k in adapted), moved
    # the best model, as petfunc eval and the calculator read it, is the merged one
    for path in (tmp_path / "run" / "best.ckpt", tmp_path / "run" / "best_params.pt"):
        _, loaded = load_model(path, dtype=torch.float64)
        a, b = tree.flatten(loaded), tree.flatten(result.params)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = fit(
        None,
        tmp_path / "resumed",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lambda m: None,
    )
    a, b = tree.flatten(result.last_params), tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # options with another rank and alpha: the checkpoint's adapters and scaling go on
    # (the adapters stayed rank 2 and were scaled by the new alpha over the old rank)
    lines = []
    other = _heads_options(data, checkpoint, method="lora", config={"rank": 3, "alpha": 5})
    resumed = fit(
        other,
        tmp_path / "resumed_other",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lines.append,
    )
    b = tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("has LoRA adapters of rank 2 (alpha 4" in line for line in lines), lines
    # another method: a clear error (it failed on the optimizer state's keys)
    with pytest.raises(
        ValueError,
        match=r"is of a run with fine-tuning method 'lora', the options ask for "
        r"fine-tuning method 'heads'",
    ):
        fit(
            _heads_options(data, checkpoint),
            tmp_path / "resumed_heads",
            restart=tmp_path / "run" / "epoch_1.ckpt",
            progress=False,
            log=lambda m: None,
        )


@pytest.mark.parametrize(
    "finetune, match",
    [
        ({"method": "adapters"}, r"must be 'full', 'heads' or 'lora', got 'adapters'"),
        ({"method": "lora", "config": {"rank": 0}}, r"finetune.config.rank' must be positive"),
        ({"method": "lora", "config": {"alpha": "big"}}, r"finetune.config.alpha' must be a number"),
        ({"method": "lora", "config": {"ranks": 2}}, r"did you mean 'rank'"),
        ({"method": "lora", "config": {"target_modules": "w_in"}}, r"target_modules' must be a list"),
        ({"method": "full", "config": {"rank": 2}}, r"only used with methods 'heads' and 'lora'"),
        (
            {"config": {"head_module": ["node_heads"]}},
            r"finetune.config.head_module' .*did you mean 'head_modules'",
        ),
        ({"config": {"head_modules": "node_heads"}}, r"must be a list of module names"),
        ({"inherit_heads": {"energy2": "energy"}}, r"unknown option .*inherit_heads.energy2'"),
        ({"inherit_heads": {"energy": 3}}, r"inherit_heads.energy' must be the name of a target"),
        ({"read_from": None}, r"method: heads' needs .*finetune.read_from"),
    ],
)
def test_bad_finetune_sections(base, finetune, match):
    data, checkpoint = base
    with pytest.raises(ValueError, match=match):
        resolve_options(_heads_options(data, checkpoint, **finetune))


@needs_metatrain
def test_inherit_heads_picks_the_source_target(base, tmp_path):
    """``inherit_heads: {energy: NAME}`` fine-tunes from target NAME of a metatrain
    checkpoint with several energy targets: the initial heads are NAME's; without it
    the error names the option; a petfunc file has only 'energy'."""
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    from petfunc.trainer.training import _initial_model

    data, checkpoint = base
    config, _ = load_model(checkpoint)
    targets = {
        name: get_energy_target_info(name, {"quantity": "energy", "unit": "eV"})
        for name in ("mtt::a", "mtt::b")
    }
    info = DatasetInfo(length_unit="angstrom", atomic_types=list(config.atomic_types), targets=targets)
    model = MetatrainPET(ref.make_model(config).hypers, info)
    path = tmp_path / "two_targets.ckpt"
    torch.save(model.get_checkpoint(), path)
    state = model.state_dict()

    options = resolve_options(_heads_options(data, path, inherit_heads={"energy": "mtt::b"}))
    lines = []
    _, params = _initial_model(options, {}, [], torch.float64, "cpu", 0, lines.append)
    flat = tree.flatten(params)
    assert torch.equal(
        flat["node_heads.energy.0.0.weight"], state["backend.node_heads.mtt::b.0.0.weight"].double()
    )
    assert not torch.equal(
        flat["node_heads.energy.0.0.weight"], state["backend.node_heads.mtt::a.0.0.weight"].double()
    )
    assert "heads of its target 'mtt::b'" in lines[-1]
    # a metatrain checkpoint is fine-tuned, not restarted
    with pytest.raises(
        ValueError, match="is a metatrain checkpoint, not a petfunc training checkpoint.*--finetune"
    ):
        fit(None, tmp_path / "restart", restart=path, progress=False, log=lambda m: None)
    result = fit(
        _heads_options(data, path, inherit_heads={"energy": "mtt::b"}),
        None,
        progress=False,
        log=lambda m: None,
    )
    assert np.isfinite(result.history[-1]["val_loss"])
    with pytest.raises(ValueError, match=r"inherit_heads: \{energy: NAME\}"):
        fit(_heads_options(data, path), None, progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match=r"no target 'mtt::c'"):
        fit(
            _heads_options(data, path, inherit_heads={"energy": "mtt::c"}),
            None,
            progress=False,
            log=lambda m: None,
        )
    # petfunc eval --target reads that head too
    from petfunc.cli.commands import main

    assert main(["eval", str(path), str(data), "--target", "mtt::b", "--json", str(tmp_path / "m.json")]) == 0
    assert main(["eval", str(path), str(data)]) == 2
    with pytest.raises(ValueError, match=r"only target is 'energy', not 'mtt::b'"):
        fit(
            _heads_options(data, checkpoint, inherit_heads={"energy": "mtt::b"}),
            None,
            progress=False,
            log=lambda m: None,
        )
    # a dataset target named like one of the checkpoint's: that target is fine-tuned,
    # its heads and its composition and scale kept, as metatrain does
    named = _heads_options(data, path)
    named["training_set"] = {
        "systems": str(data),
        "targets": {"mtt::b": {"key": "energy", "quantity": "energy"}},
    }
    _, params = _initial_model(resolve_options(named), {}, [], torch.float64, "cpu", 0, lambda m: None)
    assert torch.equal(
        tree.flatten(params)["node_heads.energy.0.0.weight"],
        state["backend.node_heads.mtt::b.0.0.weight"].double(),
    )
    result = fit(named, None, progress=False, log=lambda m: None)
    _, source = load_model(path, dtype=torch.float64, target="mtt::b")
    assert torch.equal(result.params["composition_weights"], source["composition_weights"])
    # a name the checkpoint lacks: metatrain starts new heads; petfunc asks which to start from
    named["training_set"]["targets"] = {"mtt::c": {"key": "energy", "quantity": "energy"}}
    with pytest.raises(ValueError, match=r"has no target 'mtt::c': metatrain would start new heads"):
        fit(named, None, progress=False, log=lambda m: None)
    # metatrain's inherit_heads is keyed by the trained target's name: the composition
    # of that new target is fitted on the new data
    named["architecture"]["training"]["finetune"]["inherit_heads"] = {"mtt::c": "mtt::a"}
    lines = []
    result = fit(named, None, progress=False, log=lines.append)
    assert not torch.equal(result.params["composition_weights"], source["composition_weights"])
    assert not any("of the fine-tuning checkpoint" in line for line in lines)


def test_heads_that_match_nothing(base, tmp_path):
    data, checkpoint = base
    options = _heads_options(data, checkpoint, config={"head_modules": ["readout"], "last_layer_modules": []})
    with pytest.raises(ValueError, match=r"no parameter path starts with any of \['readout'\]"):
        fit(options, tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run" / "last.ckpt").exists()
    options = _heads_options(data, checkpoint, method="lora", config={"target_modules": ["attention"]})
    with pytest.raises(ValueError, match=r"no linear layer is named any of \['attention'\]"):
        fit(options, tmp_path / "lora", progress=False, log=lambda m: None)


def test_command_line_flags(base, tmp_path, capsys):
    """`petfunc train options.yaml --finetune MODEL --finetune-method lora`."""
    import yaml

    from petfunc.cli.commands import main

    data, checkpoint = base
    options = _heads_options(data, checkpoint)
    del options["architecture"]["training"]["finetune"]
    options["architecture"]["training"]["num_epochs"] = 1
    (tmp_path / "options.yaml").write_text(yaml.safe_dump(options))
    args = [
        "train",
        str(tmp_path / "options.yaml"),
        "--finetune",
        str(checkpoint),
        "--finetune-method",
        "lora",
        "--output",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    saved = json.loads(torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)["options"])
    assert saved["architecture"]["training"]["finetune"]["method"] == "lora"
    assert "LoRA adapters of rank 4 (alpha 8)" in capsys.readouterr().out
    # without an options file: the model is the checkpoint's (the demo's architecture
    # was compared with it: "d_pet: 32 here, 8 in it")
    args = [
        "train",
        "--set",
        f"training_set={data}",
        "--finetune",
        str(checkpoint),
        "--finetune-method",
        "heads",
        "--epochs",
        "1",
        "--output",
        str(tmp_path / "bare"),
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads(torch.load(tmp_path / "bare" / "last.ckpt", weights_only=True)["config"])["d_pet"] == 8
