"""The training loop (petfunc.trainer.training): loss falls, exact resume, NaN stop,
checkpoint format, data-parallel seam, option and label errors.

All runs use a tiny PET (d_pet=8, one GNN layer, cutoff 3 Å: nearest neighbours of
fcc) on a few EMT structures, so each fit takes seconds.
"""

import copy
import hashlib
import json
import math

import numpy as np
import pytest
import torch

from petfunc import tree
from petfunc.cli import main, make_default_dataset
from petfunc.model.pet import PET
from petfunc.train.step import make_optimizer, trainable, warmup_cosine
from petfunc.data.batching import batch_plan
from petfunc.io import load_model, read_checkpoint
from petfunc.io.checkpoint import state_from_plain, state_to_plain
from petfunc.trainer import TrainingError, fit
from petfunc.trainer.options import parse_loss, resolve_options


TINY_MODEL = {
    "cutoff": 3.0,
    "cutoff_width": 0.5,
    "d_pet": 8,
    "d_head": 8,
    "d_node": 8,
    "d_feedforward": 8,
    "num_heads": 2,
    "num_attention_layers": 1,
    "num_gnn_layers": 1,
}


@pytest.fixture(scope="session")
def dataset(tmp_path_factory):
    # 16 structures: 8, 16, 32 and 12 atoms, EMT energies, forces, stresses
    return make_default_dataset(tmp_path_factory.mktemp("data") / "emt.xyz", n_structures=16, seed=1)


def tiny_options(dataset, **training):
    options = {
        "seed": 3,
        "architecture": {
            "name": "pet",
            "model": dict(TINY_MODEL),
            "training": {"batch_size": 4, "num_epochs": 2, "learning_rate": 1e-2, **training},
        },
        "training_set": str(dataset),
        "validation_set": 0.25,
    }
    return options


def quiet(lines=None):
    return (lambda message: lines.append(message)) if lines is not None else (lambda message: None)


def params_equal(a, b):
    fa, fb = tree.flatten(a), tree.flatten(b)
    assert fa.keys() == fb.keys()
    return all(torch.equal(fa[k], fb[k]) for k in fa)


def test_loss_falls(dataset, tmp_path):
    # Energies and forces only, d_pet=16, 10 epochs of 6 steps.
    options = tiny_options(dataset, num_epochs=10, learning_rate=3e-2, batch_size=2)
    options["architecture"]["model"].update(d_pet=16, d_head=16, d_node=16, d_feedforward=16)
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"stress": False}}}
    result = fit(options, tmp_path, progress=False, log=quiet())
    losses = [row["train_loss"] for row in result.history]
    val = [row["val_loss"] for row in result.history]
    assert min(losses[-3:]) < 0.5 * losses[0], f"training losses per epoch: {losses}"
    assert min(val[-3:]) < 0.7 * val[0], f"validation losses per epoch: {val}"
    # Stress is off: no stress column; validation metrics are there.
    assert "train_stress_rmse" not in result.history[0]
    assert all(math.isfinite(row["val_forces_rmse"]) for row in result.history)
    assert 1 <= result.best_epoch <= 10
    # Files.
    for name in ("last.ckpt", "best.ckpt", "metrics.csv", "parity.png", "best_params.pt"):
        assert (tmp_path / name).is_file(), name
    csv_lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == 11 and csv_lines[0].startswith("epoch,step,learning_rate,train_loss")


def test_missing_auto_labels_are_reported(dataset, tmp_path):
    """Forces stored under another key than the one looked for: training goes on with
    energies only, and says so (as metatrain's "No forces found")."""
    import ase.io

    frames = ase.io.read(dataset, ":")
    for atoms in frames:
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = None
        atoms.info["energy"] = energy
        atoms.arrays["dft_forces"] = forces
    ase.io.write(tmp_path / "renamed.xyz", frames)
    lines = []
    result = fit(tiny_options(tmp_path / "renamed.xyz", num_epochs=1), None, progress=False, log=quiet(lines))
    assert (
        "no forces labels in the training files (looked for 'forces'): training without the forces term"
        in lines
    )
    assert any(line.startswith("no stress labels") for line in lines)
    assert "train_forces_rmse" not in result.history[0]


def test_error_metrics_skip_missing_labels_not_nan_predictions():
    import numpy as np

    from petfunc.trainer import error_metrics

    pred = {
        "energy_per_atom": [1.0, 2.0, np.nan],
        "energy_per_atom_ref": [1.5, np.nan, 3.0],
        "forces": [[0.0, 1.0, 2.0]],
        "forces_ref": [[1.0, np.nan, 0.0]],
        "stress": [],
        "stress_ref": [],
    }
    out = error_metrics(pred)
    assert math.isnan(out["energy_per_atom_rmse"]) and out["energy_per_atom_count"] == 2
    assert out["energy_per_atom_nan_predictions"] == 1
    assert out["forces_rmse"] == pytest.approx(math.sqrt(2.5)) and out["forces_count"] == 2
    assert "forces_nan_predictions" not in out and "stress_rmse" not in out


def test_log_interval_only_spaces_the_printed_lines(dataset):
    """metatrain validates and picks the best model every epoch; log_interval only
    says how often a line is printed. The best epoch must not depend on it."""
    runs = {}
    for interval in (1, 3):
        lines = []
        result = fit(
            tiny_options(dataset, num_epochs=4, log_interval=interval), None, progress=False, log=quiet(lines)
        )
        printed = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("epoch ")]
        runs[interval] = result, printed
    (one, printed_one), (three, printed_three) = runs[1], runs[3]
    assert printed_one == [1, 2, 3, 4] and printed_three == [1, 3, 4]
    assert all(math.isfinite(row["val_loss"]) for row in three.history) and len(three.history) == 4
    assert [row["selection_metric"] for row in three.history] == [
        row["selection_metric"] for row in one.history
    ]
    metrics = [row["selection_metric"] for row in three.history]
    assert three.best_epoch == one.best_epoch == 1 + metrics.index(min(metrics))
    assert params_equal(three.params, one.params)


def assert_plain(node):
    """Only dicts, lists, tensors and plain scalars (no NamedTuples, no objects)."""
    if isinstance(node, dict):
        for value in node.values():
            assert_plain(value)
    elif isinstance(node, list):
        for value in node:
            assert_plain(value)
    else:
        assert node is None or isinstance(node, (torch.Tensor, str, int, float, bool)), type(node)


def test_atomic_baseline_fixes_the_composition(dataset):
    """metatrain's atomic_baseline: a weight per type, or one weight for all types;
    the scale is then fitted on the residual of the fixed weights."""
    baseline = {"energy": {13: -3.5, "28": -5.0, 29: -4.0}}  # YAML/JSON may give string keys
    result = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline=baseline), None, progress=False, log=quiet()
    )
    weights = result.params["composition_weights"]
    assert weights.tolist() == [-3.5, -5.0, -4.0]
    result = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": -2.0}),
        None,
        progress=False,
        log=quiet(),
    )
    assert result.params["composition_weights"].tolist() == [-2.0, -2.0, -2.0]
    with pytest.raises(ValueError, match=r"no weight for atomic type\(s\) \[28\]"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": {13: -3.5, 29: -4.0}}),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(FileNotFoundError, match="no composition checkpoint at"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline="missing.ckpt"),
            None,
            progress=False,
            log=quiet(),
        )


def _mtt_train(tmp_path, name, architecture, dataset, cwd):
    """``mtt train`` (metatrain's command) on ``dataset``; returns its checkpoint."""
    import subprocess
    import sys

    import yaml

    options = {
        "seed": 7,
        "architecture": architecture,
        "validation_set": 0.25,
        "test_set": 0.0,
        "training_set": {"systems": str(dataset), "targets": {"energy": {"key": "energy", "unit": "eV"}}},
    }
    (cwd / f"{name}.yaml").write_text(yaml.safe_dump(options))
    subprocess.run(
        [sys.executable, "-m", "metatrain", "train", f"{name}.yaml", "-o", f"{name}.pt"],
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    return cwd / f"{name}.ckpt"


def test_composition_and_scaler_checkpoints_like_mtt_train(dataset, tmp_path):
    """metatrain's atomic_baseline: composition.ckpt and fixed_scaling_weights:
    scaler.ckpt (checkpoints of mtt train's composition and scaler architectures):
    the composition and scale petfunc trains with equal those mtt train's PET gets."""
    pytest.importorskip("metatrain")
    import petfunc

    composition = _mtt_train(tmp_path, "composition", {"name": "composition"}, dataset, tmp_path)
    scaler = _mtt_train(
        tmp_path,
        "scaler",
        {"name": "scaler", "training": {"additive_models": [str(composition)]}},
        dataset,
        tmp_path,
    )
    model = dict(TINY_MODEL)
    training = {
        "num_epochs": 1,
        "batch_size": 4,
        "atomic_baseline": str(composition),
        "fixed_scaling_weights": str(scaler),
    }
    reference = _mtt_train(
        tmp_path, "pet", {"name": "pet", "model": model, "training": training}, dataset, tmp_path
    )
    _, expected = petfunc.from_metatrain(reference)

    options = tiny_options(dataset, **{**training, "num_epochs": 0})
    result = fit(options, None, progress=False, log=quiet())
    assert torch.equal(result.params["composition_weights"], expected["composition_weights"])
    assert float(result.params["energy_scale"]) == float(expected["energy_scale"])
    own = fit(tiny_options(dataset, num_epochs=0), None, progress=False, log=quiet()).params  # another split
    assert not torch.equal(own["composition_weights"], expected["composition_weights"])
    assert float(own["energy_scale"]) != float(expected["energy_scale"])

    # the composition alone: the scale is fitted on its residual, as with fixed weights
    fixed = {int(z): float(w) for z, w in zip(result.config.atomic_types, expected["composition_weights"])}
    alone = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline=str(composition)),
        None,
        progress=False,
        log=quiet(),
    ).params
    by_value = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": fixed}),
        None,
        progress=False,
        log=quiet(),
    ).params
    assert float(alone["energy_scale"]) == float(by_value["energy_scale"])

    # metatrain's checks, with petfunc's messages
    unscaled = _mtt_train(tmp_path, "plain_scaler", {"name": "scaler"}, dataset, tmp_path)
    with pytest.raises(ValueError, match=r"fitted after subtracting the additive models \[\]"):
        fit(
            tiny_options(
                dataset, num_epochs=0, atomic_baseline=str(composition), fixed_scaling_weights=str(unscaled)
            ),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(ValueError, match="holds a Scaler, not a metatrain CompositionModel"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline=str(scaler)),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(ValueError, match="fitted on energies in 'eV', the training data are in 'Hartree'"):
        hartree = tiny_options(dataset, num_epochs=0, atomic_baseline=str(composition))
        hartree["training_set"] = {"systems": str(dataset), "targets": {"energy": {"unit": "Hartree"}}}
        fit(hartree, None, progress=False, log=quiet())
    with pytest.raises(
        ValueError, match="needs 'architecture.training.atomic_baseline' to name a composition"
    ):
        resolve_options(
            {"training_set": "x.xyz", "architecture": {"training": {"fixed_scaling_weights": "s.ckpt"}}}
        )


def test_fixed_scaling_weights(dataset):
    """metatrain's fixed_scaling_weights: {energy: c} replaces the fitted scale, the
    composition is still fitted, and scale_targets: false wins (scale 1)."""
    fitted = fit(tiny_options(dataset, num_epochs=0), None, progress=False, log=quiet()).params
    result = fit(
        tiny_options(dataset, num_epochs=0, fixed_scaling_weights={"energy": 0.25}),
        None,
        progress=False,
        log=quiet(),
    )
    assert float(result.params["energy_scale"]) == 0.25 != float(fitted["energy_scale"])
    assert torch.equal(result.params["composition_weights"], fitted["composition_weights"])
    result = fit(
        tiny_options(dataset, num_epochs=0, fixed_scaling_weights={"energy": 0.25}, scale_targets=False),
        None,
        progress=False,
        log=quiet(),
    )
    assert float(result.params["energy_scale"]) == 1.0
    for bad, message in (
        ({"energy": {13: 1.0}}, "per-structure energy target"),
        ({"energy": 0.0}, "positive"),
        ({"forces": 1.0}, "forces"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_options(
                {"training_set": "x.xyz", "architecture": {"training": {"fixed_scaling_weights": bad}}}
            )


def test_checkpoint_contents(dataset, tmp_path):
    result = fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    # Plain data only: loads with weights_only=True.
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["format"] == "petfunc.checkpoint" and ckpt["epoch"] == 1 and ckpt["step"] == 3
    assert_plain(ckpt["opt_state"])
    assert json.loads(ckpt["options"])["architecture"]["model"]["d_pet"] == 8
    assert ckpt["composition"]["atomic_types"] == [13, 28, 29]
    assert ckpt["composition"]["weights"].dtype == torch.float64
    # The fitted composition and scale are in the params, not trained.
    assert torch.equal(ckpt["params"]["composition_weights"], ckpt["composition"]["weights"])
    assert ckpt["params"]["energy_scale"].item() == ckpt["energy_scale"]
    assert ckpt["params"]["gnn_layers.0.edge_embedder.weight"].dtype == torch.float32
    # load_model gives (config, params) for the checkpoint and the params file alike.
    config, params = load_model(tmp_path / "best.ckpt")
    config2, params2 = load_model(tmp_path / "best_params.pt")
    assert config == config2 == result.config
    assert params_equal(params, params2) and params_equal(params, result.params)


def test_exact_resume_float64(dataset, tmp_path):
    # Uninterrupted: 3 epochs, with a checkpoint after every epoch.
    options = tiny_options(dataset, num_epochs=3, checkpoint_interval=1)
    options["base_precision"] = 64
    full = fit(options, tmp_path / "full", progress=False, log=quiet())
    # Continue from the checkpoint of epoch 1 in another folder.
    resumed = fit(
        None, tmp_path / "resumed", restart=tmp_path / "full" / "epoch_1.ckpt", progress=False, log=quiet()
    )
    assert params_equal(full.last_params, resumed.last_params), "resumed parameters differ"
    assert params_equal(full.params, resumed.params) and full.best_epoch == resumed.best_epoch
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]
    for a, b in zip(full.history, resumed.history):
        assert a["train_loss"] == b["train_loss"] and a["val_loss"] == b["val_loss"]
    a = read_checkpoint(tmp_path / "full" / "last.ckpt")["opt_state"]
    b = read_checkpoint(tmp_path / "resumed" / "last.ckpt")["opt_state"]
    leaves_a, leaves_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_restart_keeps_the_split(dataset, tmp_path):
    """Checkpoints store the file indices of the training and validation structures
    and a restart reads them (so a change of the split rule never moves structures
    between the sets of a running training); checkpoints without them get the rule
    of the versions that wrote them; a file that changed size is an error."""
    import ase.io

    fit(tiny_options(dataset, num_epochs=1), tmp_path / "run", progress=False, log=quiet())
    ckpt = read_checkpoint(tmp_path / "run" / "last.ckpt")
    train, val = ckpt["split"]["training"][0], ckpt["split"]["validation"][0]
    assert len(val) == 4 and sorted(train + val) == list(range(16))

    def restart_sizes(split):
        ckpt["split"] = split
        torch.save(ckpt, tmp_path / "edited.ckpt")
        lines = []
        options = json.loads(ckpt["options"])
        options["architecture"]["training"]["num_epochs"] = 2
        fit(
            options,
            tmp_path / "restarted",
            restart=tmp_path / "edited.ckpt",
            progress=False,
            log=quiet(lines),
        )
        return next(line for line in lines if line.startswith("training set:"))

    assert "training set: 10 structures (160 atoms), validation set: 6" in restart_sizes(
        {"training": [train[:-2]], "validation": [val + train[-2:]]}
    )
    # legacy checkpoints: round(0.25 * 16) = 4 validation structures
    assert "validation set: 4 structures" in restart_sizes(None)
    ckpt["split"] = {"training": [train], "validation": [val]}
    torch.save(ckpt, tmp_path / "edited.ckpt")
    # options asking for another split are an error, not ignored
    for name, value, message in (
        ("validation_set", 0.5, "'validation_set' is 0.5 here, 0.25 in the run"),
        ("test_set", 0.1, "'test_set' is 0.1 here, 0 in the run"),
        ("validation_set", str(dataset), "is a separate file here, 0.25 in the run"),
    ):
        options = json.loads(ckpt["options"])
        options[name] = value
        options["architecture"]["training"]["num_epochs"] = 2
        with pytest.raises(ValueError, match=message):
            fit(options, tmp_path / "resplit", restart=tmp_path / "edited.ckpt", progress=False, log=quiet())
    assert not (tmp_path / "resplit").exists() or not any((tmp_path / "resplit").iterdir())
    ase.io.write(tmp_path / "fewer.xyz", ase.io.read(dataset, ":10"))
    options = json.loads(ckpt["options"])
    options["training_set"]["systems"]["read_from"] = str(tmp_path / "fewer.xyz")
    options["architecture"]["training"]["num_epochs"] = 2
    with pytest.raises(ValueError, match=r"training data changed since the checkpoint.*\[16\].*\[10\]"):
        fit(options, tmp_path / "changed", restart=tmp_path / "edited.ckpt", progress=False, log=quiet())


def test_restart_makes_the_folder_agree_with_the_checkpoint(dataset, tmp_path):
    """A restart leaves best.ckpt holding the checkpoint's best epoch: after a kill
    between last.ckpt and best.ckpt (best.ckpt stayed an older epoch), after a
    restart from an earlier checkpoint into a folder that went further, and in a new
    folder; without a source it removes a stale best.ckpt and says so. A run killed
    after its last epoch's checkpoint is finished by a restart at that epoch."""
    options = tiny_options(dataset, num_epochs=3, checkpoint_interval=1, learning_rate=3e-3)
    result = fit(options, tmp_path / "run", progress=False, log=quiet())
    run = tmp_path / "run"
    best_bytes = (run / "best.ckpt").read_bytes()
    best_epoch = result.best_epoch
    older = 1 if best_epoch != 1 else 2
    assert read_checkpoint(run / "best.ckpt")["epoch"] == best_epoch

    # the kill: best.ckpt of an older epoch, no best_params.pt, plots or last CSV row
    (run / "best.ckpt").write_bytes((run / f"epoch_{older}.ckpt").read_bytes())
    (run / "best_params.pt").unlink()
    (run / "parity.png").unlink()
    rows = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join(rows[:-1]) + "\n")
    lines = []
    finished = fit(None, restart=run / "last.ckpt", progress=False, log=quiet(lines))
    assert any("nothing to train, writing the end-of-run files" in line for line in lines)
    assert (run / "best.ckpt").read_bytes() == best_bytes
    assert (run / "best_params.pt").exists() and (run / "parity.png").exists()
    assert len((run / "metrics.csv").read_text().splitlines()) == len(rows)
    assert finished.best_epoch == best_epoch and params_equal(finished.params, result.params)

    # a restart from epoch 1 into the same folder, with another learning rate: nothing
    # of the folder is replaced before its first last.ckpt (here it stops before)
    changed = json.loads(read_checkpoint(run / "epoch_1.ckpt")["options"])
    changed["architecture"]["training"].update(num_epochs=2, learning_rate=0.3)
    before = {p.name: p.read_bytes() for p in run.glob("*.ckpt")}

    def stop_at_training(message):
        if message.startswith("training set:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(changed, run, restart=run / "epoch_1.ckpt", progress=False, log=stop_at_training)
    assert {p.name: p.read_bytes() for p in run.glob("*.ckpt")} == before
    lines = []
    fit(changed, run, restart=run / "epoch_1.ckpt", progress=False, log=quiet(lines))
    assert any(
        "epoch_2.ckpt, epoch_3.ckpt of later epochs of the run this restart continues, or of another run"
        in line
        for line in lines
    )
    final = next(line for line in lines if line.startswith("files of this run"))
    assert "epoch_2.ckpt" in final and "epoch_3.ckpt" not in final
    best = read_checkpoint(run / "best.ckpt")
    assert best["epoch"] == read_checkpoint(run / "last.ckpt")["best_epoch"]

    # a restart at the last epoch into a new folder: a last.ckpt there too
    fit(None, tmp_path / "ended", restart=run / "epoch_2.ckpt", progress=False, log=quiet())
    assert read_checkpoint(tmp_path / "ended" / "last.ckpt")["epoch"] == 2

    # a fresh run into a used folder says what it replaces
    lines = []
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet(lines))
    assert any(
        "holds the last.ckpt and best.ckpt of another run: this run replaces them" in line for line in lines
    )
    assert any("epoch_2.ckpt, epoch_3.ckpt of another run: they stay" in line for line in lines)

    # a new folder: the best epoch's checkpoint is copied from the old one
    fit(options, tmp_path / "again", progress=False, log=quiet())
    lines = []
    fit(None, tmp_path / "new", restart=tmp_path / "again" / "last.ckpt", progress=False, log=quiet(lines))
    best_bytes = (tmp_path / "again" / "best.ckpt").read_bytes()
    assert (tmp_path / "new" / "best.ckpt").read_bytes() == best_bytes
    assert any(line.startswith(f"best.ckpt: epoch {best_epoch}") for line in lines)
    # no source of the best epoch: a stale best.ckpt is removed, and that is said
    (tmp_path / "lone").mkdir()
    ckpt = read_checkpoint(tmp_path / "again" / "last.ckpt")
    ckpt["best_epoch"] = 2
    ckpt["best_params"] = {k: v + 1.0 for k, v in ckpt["params"].items()}  # held by no file
    torch.save(ckpt, tmp_path / "lone" / "last.ckpt")
    (tmp_path / "lone" / "best.ckpt").write_bytes(best_bytes)
    lines = []
    fit(None, restart=tmp_path / "lone" / "last.ckpt", progress=False, log=quiet(lines))
    assert not (tmp_path / "lone" / "best.ckpt").exists()
    assert any(line.startswith("removed best.ckpt (another epoch's); the best epoch (2)") for line in lines)


def test_test_set(dataset, tmp_path):
    """``test_set``: split off as mtt train does (stored in the checkpoint, kept on a
    restart), evaluated with the best model at the end: the RMSE equals one computed
    here with the calculator on those file indices; a separate file works too."""
    import ase.io

    from petfunc.ase.calculator import PETCalculator

    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    options["test_set"] = 0.25
    lines = []
    result = fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    assert any(
        "training set: 8 structures" in line
        and "validation set: 4 structures, test set: 4 structures" in line
        for line in lines
    ), lines
    split = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    test = split["test"][0]
    assert len(test) == 4 and sorted(split["training"][0] + split["validation"][0] + test) == list(range(16))
    frames = ase.io.read(dataset, ":")
    calc = PETCalculator(result.config, result.params)
    errors, forces = [], []
    for i in test:
        atoms = frames[i].copy()
        reference_e, reference_f = frames[i].get_potential_energy(), frames[i].get_forces()
        atoms.calc = calc
        errors.append((atoms.get_potential_energy() - reference_e) / len(atoms))
        forces.append(atoms.get_forces() - reference_f)
    assert result.test_errors["energy_per_atom_rmse"] == pytest.approx(
        np.sqrt(np.mean(np.square(errors))), rel=1e-9
    )
    assert result.test_errors["forces_rmse"] == pytest.approx(
        np.sqrt(np.mean(np.square(np.concatenate(forces)))), rel=1e-9
    )
    assert any(line.startswith("test set (4 structures)") for line in lines)
    assert (tmp_path / "run" / "parity_test.png").stat().st_size > 0

    # a restart keeps the test set of the run it continues
    options["architecture"]["training"]["num_epochs"] = 2
    lines = []
    fit(
        options,
        tmp_path / "restarted",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any("test set: 4 structures" in line for line in lines)
    assert read_checkpoint(tmp_path / "restarted" / "last.ckpt")["split"] == split

    # a separate test file; fractions that leave nothing to train on are an error
    options = tiny_options(dataset, num_epochs=1)
    ase.io.write(tmp_path / "test.xyz", frames[:3])
    options["test_set"] = str(tmp_path / "test.xyz")
    result = fit(options, None, progress=False, log=quiet())
    assert set(result.test_errors) >= {"energy_per_atom_rmse", "forces_rmse", "stress_rmse"}
    options["test_set"] = 0.75
    with pytest.raises(ValueError, match="'validation_set' and 'test_set' take all of the data"):
        fit(options, None, progress=False, log=quiet())
    options["test_set"] = [str(tmp_path / "test.xyz")] * 2
    with pytest.raises(ValueError, match="option 'test_set' lists 2 dataset"):
        fit(options, None, progress=False, log=quiet())

    # the test set does not add atomic types to the model (as in metatrain): a type
    # only it has is an error before training; one only the validation set has is
    # a type of the model, with a warning
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    odd = frames[0].copy()
    odd.numbers[0] = 47
    odd.calc = EMT()
    odd.calc = SinglePointCalculator(
        odd, energy=odd.get_potential_energy(), forces=odd.get_forces(), stress=odd.get_stress()
    )
    ase.io.write(tmp_path / "silver.xyz", [odd])
    options["test_set"] = str(tmp_path / "silver.xyz")
    with pytest.raises(ValueError, match=r"the test set has atomic type\(s\) \[47\] that the model lacks"):
        fit(options, tmp_path / "silver", progress=False, log=quiet())
    assert not (tmp_path / "silver" / "last.ckpt").exists()
    options["test_set"], options["validation_set"] = None, str(tmp_path / "silver.xyz")
    lines = []
    result = fit(options, None, progress=False, log=quiet(lines))
    assert 47 in result.config.atomic_types
    assert any("atomic type(s) [47] appear in the validation set only" in line for line in lines)


def test_per_structure_targets(dataset, tmp_path):
    """``per_structure_targets: [energy]``: the scale is the RMS of the per-structure
    residual and the logged validation energy RMSE is per structure: it equals one
    computed here with the calculator (eV, float64)."""
    import ase.io

    from petfunc.ase.calculator import PETCalculator
    from petfunc.data.samples import fit_scale, sample_from_atoms

    options = tiny_options(dataset, num_epochs=1, per_structure_targets=["energy"])
    options["base_precision"] = 64
    lines = []
    result = fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    assert any("energy per structure (eV)" in line for line in lines), lines
    split = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    frames = ase.io.read(dataset, ":")
    config = result.config
    train = [sample_from_atoms(frames[i], config) for i in split["training"][0]]
    composition = result.last_params["composition_weights"].numpy()
    scale = float(result.last_params["energy_scale"])
    assert scale == pytest.approx(fit_scale(train, composition, per_atom=False), rel=1e-14)
    assert abs(scale / fit_scale(train, composition) - 1) > 0.5
    calc = PETCalculator(config, result.last_params)
    errors = []
    for i in split["validation"][0]:
        atoms = frames[i].copy()
        reference = frames[i].get_potential_energy()
        atoms.calc = calc
        errors.append(atoms.get_potential_energy() - reference)
    expected = float(np.sqrt(np.mean(np.square(errors))))
    assert result.history[-1]["val_energy_rmse"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match=r"per_structure_targets': unknown target\(s\) \['forces'\]"):
        fit(tiny_options(dataset, per_structure_targets=["forces"]), None, progress=False, log=quiet())


def test_max_atoms_per_batch(dataset, tmp_path):
    """Batches packed by atom count: the step count is the packing's (structures of
    32 atoms are skipped with max_atoms_per_batch 30, with a warning), training runs;
    bad values are errors that name the option."""
    import ase.io

    from petfunc.data.read import split_datasets

    options = tiny_options(dataset, num_epochs=2, max_atoms_per_batch=30)
    lines = []
    result = fit(options, None, progress=False, log=quiet(lines))
    ((train, _, _),) = split_datasets([16], 0.25, seed=3)
    counts = [len(ase.io.read(dataset, int(i))) for i in train]
    steps = len(batch_plan(len(counts), 4, atom_counts=counts, max_atoms=30))
    assert steps > 0 and any(f"{steps} steps per epoch" in line for line in lines), (steps, lines)
    skipped = sum(c > 30 for c in counts)
    assert skipped and any(
        f"warning: {skipped} training structure(s) have more than" in line for line in lines
    )
    assert result.history[-1]["step"] == 2 * steps and np.isfinite(result.history[-1]["val_loss"])
    for bad, message in (
        ({"max_atoms_per_batch": 0}, "max_atoms_per_batch' must be positive"),
        ({"min_atoms_per_batch": 5}, "min_atoms_per_batch' needs"),
        ({"max_atoms_per_batch": 30, "min_atoms_per_batch": 31}, "exceeds"),
        ({"max_atoms_per_batch": 5}, "no training batch is left"),
    ):
        with pytest.raises(ValueError, match=message):
            fit(tiny_options(dataset, num_epochs=1, **bad), None, progress=False, log=quiet())


def test_split_step_matches_fused(dataset, tmp_path):
    # grad_step + reduce_grads + apply_gradients (the data-parallel path) == train_step.
    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    calls = []

    def reduce_grads(grads):
        calls.append(1)
        return grads

    fused = fit(options, None, progress=False, log=quiet())
    split = fit(options, None, progress=False, log=quiet(), reduce_grads=reduce_grads)
    assert len(calls) == 3
    assert params_equal(fused.last_params, split.last_params)


def test_remat_training_equals_plain(dataset, monkeypatch):
    # recomputed transformer layers (petfunc.remat): the same training, float64,
    # through the train step and the validation loss
    from petfunc import remat as remat_module

    options = tiny_options(dataset, num_epochs=2)
    options["base_precision"] = 64
    options["architecture"]["model"]["num_attention_layers"] = 2
    plain = fit(options, None, progress=False, log=quiet())
    checkpointed = []
    original = remat_module.checkpoint
    monkeypatch.setattr(
        remat_module, "checkpoint", lambda *a, **k: checkpointed.append(1) or original(*a, **k)
    )
    options["architecture"]["training"]["remat"] = True
    recomputed = fit(options, None, progress=False, log=quiet())
    assert checkpointed  # the layers did go through torch.utils.checkpoint
    fa, fb = tree.flatten(plain.last_params), tree.flatten(recomputed.last_params)
    for key in fa:
        torch.testing.assert_close(fa[key], fb[key], rtol=1e-12, atol=1e-14, msg=key)
    assert plain.history[-1]["val_loss"] == pytest.approx(recomputed.history[-1]["val_loss"], rel=1e-12)


def test_batch_plan_shards():
    """Training shards (``batch_size`` per process): step k of W processes is the
    one-process batch k of W * batch_size, shared with at most one structure of
    difference, the lone partial batch of a small set included (it was cut to a
    multiple of W: 3 structures trained as 2)."""
    for n, size, world, drop_last in (
        (23, 4, 2, True),
        (23, 4, 2, False),
        (3, 2, 2, True),
        (10, 3, 3, True),
        (7, 8, 2, True),
        (40, 4, 2, True),
        (5, 1, 4, False),
    ):
        full = batch_plan(n, size * world, epoch=2, seed=5, drop_last=drop_last)
        shards = [
            batch_plan(n, size, epoch=2, seed=5, drop_last=drop_last, rank=r, world_size=world)
            for r in range(world)
        ]
        expected = [b for b in full if len(b) >= world]  # (5, 1, 4): the last structure alone is left out
        assert all(len(s) == len(expected) for s in shards), (n, size, world)
        for k, batch in enumerate(expected):
            parts = [s[k] for s in shards]
            assert 1 <= min(map(len, parts)) and max(map(len, parts)) - min(map(len, parts)) <= 1
            assert sorted(np.concatenate(parts).tolist()) == sorted(batch.tolist()), (n, size, world, k)
    assert [len(b) for b in batch_plan(3, 2, rank=0, world_size=2)] == [2]
    # a structure cannot be shared by two processes: no step (fit says so)
    assert batch_plan(1, 4, rank=0, world_size=2) == []
    # drop_last drops the partial batch; other epochs shuffle differently.
    assert [len(x) for x in batch_plan(23, 4, epoch=2, seed=5)] == [4] * 5
    assert not np.array_equal(
        np.concatenate(batch_plan(23, 4, epoch=3, seed=5)), np.concatenate(batch_plan(23, 4, epoch=2, seed=5))
    )


def test_batch_plan_one_file_per_batch():
    """Several training files (metatrain's combined loader): every batch comes from
    one file, each file drops its own partial batch, the batch order mixes files."""
    groups = [10, 7, 5]
    starts = np.cumsum([0] + groups)

    def file_of(batch):
        files = {int(np.searchsorted(starts, i, side="right") - 1) for i in batch}
        assert len(files) == 1, batch
        return files.pop()

    plan = batch_plan(22, 4, epoch=1, seed=3, groups=groups)
    assert [len(b) for b in plan] == [4] * 4  # 2 + 1 + 1 full batches
    assert sorted(file_of(b) for b in plan) == [0, 0, 1, 2]
    orders = {tuple(file_of(b) for b in batch_plan(22, 4, epoch=e, seed=3, groups=groups)) for e in range(10)}
    assert len(orders) > 3  # the files' batches are shuffled together, differently each epoch
    flat = np.concatenate(plan)
    assert len(set(flat.tolist())) == len(flat)
    # unshuffled, no drop: file order, every structure once
    ordered = batch_plan(22, 4, shuffle=False, drop_last=False, groups=groups)
    assert [file_of(b) for b in ordered] == [0, 0, 0, 1, 1, 2, 2]
    assert np.concatenate(ordered).tolist() == list(range(22))
    # ranks: disjoint shards of each file, and the same number of steps
    shards = [batch_plan(22, 2, epoch=0, seed=3, rank=r, world_size=2, groups=groups) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    assert not set(np.concatenate(shards[0]).tolist()) & set(np.concatenate(shards[1]).tolist())
    for shard in shards:
        for b in shard:
            file_of(b)
    # one file is the plain rule
    assert all(
        np.array_equal(a, b)
        for a, b in zip(batch_plan(22, 4, epoch=1, seed=3, groups=[22]), batch_plan(22, 4, epoch=1, seed=3))
    )
    with pytest.raises(ValueError, match="do not add up"):
        batch_plan(22, 4, groups=[10, 10])


def test_energy_scale_of_a_composition_that_fits_exactly():
    """As many structures as species: the composition reproduces the energies to
    round-off, and a scale of that round-off (1e-15 eV) made the loss 1e30. The
    scale is then 1 eV, with a warning; a real residual is kept."""
    import ase.build
    from ase.calculators.emt import EMT

    from petfunc import PETConfig
    from petfunc.data.samples import fit_composition, fit_scale, sample_from_atoms

    config = PETConfig(atomic_types=(13, 29), **TINY_MODEL)
    frames = []
    for n_al in (0, 1, 2):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.numbers[:n_al] = 13
        atoms.rattle(0.05, seed=n_al)
        atoms.calc = EMT()
        atoms.get_potential_energy()
        frames.append(atoms)
    samples = [sample_from_atoms(a, config) for a in frames]
    w = fit_composition(samples[:2], config.num_species)
    with pytest.warns(UserWarning, match="reproduce the 2 training energies to round-off"):
        assert fit_scale(samples[:2], w) == 1.0
    w = fit_composition(samples, config.num_species)
    residual = [(s.energy - w[s.structure.species].sum()) / len(s) for s in samples]
    assert fit_scale(samples, w) == pytest.approx(np.sqrt(np.mean(np.square(residual))), rel=1e-14)
    assert 1e-6 < fit_scale(samples, w) < 1.0


def test_too_few_structures_for_the_processes(dataset, tmp_path):
    # 3 structures (2 for training) and 3 processes: an error before any step, not
    # "0 steps per epoch", a NaN loss and untrained checkpoints
    import ase.io

    small = tmp_path / "three.xyz"
    ase.io.write(small, ase.io.read(dataset, ":3"))
    options = tiny_options(small, batch_size=1)
    options["validation_set"] = 0.34
    with pytest.raises(ValueError, match="2 training structure.*cannot be shared by 3 processes"):
        fit(
            options,
            tmp_path / "out",
            progress=False,
            log=quiet(),
            rank=0,
            world_size=3,
            reduce_grads=lambda g: g,
            reduce_metrics=lambda m: m,
        )
    assert not (tmp_path / "out" / "last.ckpt").exists()


def test_several_processes_need_a_process_group(dataset):
    """fit(world_size=2) without torch.distributed and without the hooks trained
    each process alone on its shard of every batch, without a word."""
    options = tiny_options(dataset, num_epochs=1)
    with pytest.raises(ValueError, match=r"fit\(world_size=2\) needs a torch.distributed process group of 2"):
        fit(options, None, progress=False, log=quiet(), rank=1, world_size=2)
    with pytest.raises(ValueError, match="reduce_grads and reduce_metrics"):
        fit(options, None, progress=False, log=quiet(), rank=1, world_size=2, reduce_grads=lambda g: g)
    for rank, world_size in ((2, 2), (0, 0), (-1, 2)):
        with pytest.raises(
            ValueError, match=rf"fit\(rank={rank}, world_size={world_size}\): need 0 <= rank < world_size"
        ):
            fit(
                options,
                None,
                progress=False,
                log=quiet(),
                rank=rank,
                world_size=world_size,
                reduce_grads=lambda g: g,
                reduce_metrics=lambda m: m,
            )


def test_restart_notices_an_edited_training_file(dataset, tmp_path):
    """The number of structures is not all: a label edited since the checkpoint is
    named in a warning (the restart trains on the file as it is)."""
    import ase.io

    edited = tmp_path / "data.xyz"
    edited.write_bytes(open(dataset, "rb").read())
    fit(tiny_options(edited, num_epochs=1), tmp_path / "run", progress=False, log=quiet())
    lines = []
    fit(
        tiny_options(edited, num_epochs=2),
        tmp_path / "run",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert not any("training_set changed since the checkpoint" in line for line in lines)
    frames = ase.io.read(edited, ":")
    frames[5].calc.results["energy"] += 0.1
    ase.io.write(edited, frames)
    lines = []
    fit(
        tiny_options(edited, num_epochs=3),
        tmp_path / "run",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any(line.startswith("warning: training_set changed since the checkpoint") for line in lines), lines
    # a separate validation file too (it picks the best epoch)
    validation = tmp_path / "validation.xyz"
    ase.io.write(validation, frames[:4])
    options = tiny_options(edited, num_epochs=1)
    options["validation_set"] = str(validation)
    fit(options, tmp_path / "separate", progress=False, log=quiet())
    frames[0].calc.results["energy"] -= 0.1
    ase.io.write(validation, frames[:4])
    options["architecture"]["training"]["num_epochs"] = 2
    lines = []
    fit(
        options,
        tmp_path / "separate",
        restart=tmp_path / "separate" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any(line.startswith("warning: validation_set changed since the checkpoint") for line in lines), (
        lines
    )


def test_restart_with_other_processes_names_the_batch_size(dataset, tmp_path):
    """Checkpoints store their number of processes, so a restart with another one
    that takes other batches says which --batch-size gives the same global batches."""
    fit(tiny_options(dataset, num_epochs=1), tmp_path / "one", progress=False, log=quiet())
    assert read_checkpoint(tmp_path / "one" / "last.ckpt")["world_size"] == 1
    lines = []
    fit(
        None,
        tmp_path / "two",
        restart=tmp_path / "one" / "last.ckpt",
        progress=False,
        log=quiet(lines),
        rank=0,
        world_size=2,
        reduce_grads=lambda g: g,
        reduce_metrics=lambda m: m,
    )
    options = json.loads(read_checkpoint(tmp_path / "one" / "last.ckpt")["options"])
    assert options["architecture"]["training"]["batch_size"] == 4
    warning = next(line for line in lines if "steps in 1 epochs" in line)
    assert (
        "the checkpoint's 1 process took batches of 4 structures in all: --batch-size 2 gives the same with 2"
        in warning
    )


def test_validation_loss_does_not_depend_on_batching(dataset):
    """The validation loss is that of the whole validation set as one batch, so
    ``best_model_metric: loss`` picks the same epoch with any batch size or number
    of processes (the mean of the batch losses did not)."""
    import ase.io

    from petfunc import PETConfig
    from petfunc.data.samples import fit_composition, fit_scale, make_batch, sample_from_atoms
    from petfunc.train.loss import LossTerm, LossWeights, make_loss
    from petfunc.trainer.metrics import Sums, floats

    frames = ase.io.read(dataset, ":7")
    config = PETConfig(atomic_types=tuple(sorted({int(z) for a in frames for z in a.numbers})), **TINY_MODEL)
    samples = [sample_from_atoms(a, config) for a in frames]
    samples[2].forces = None  # unequal label counts per batch
    w = fit_composition(samples, config.num_species)
    c = fit_scale(samples, w)
    params = PET(config).init(seed=0, dtype=torch.float64)
    params["composition_weights"] = torch.tensor(w)
    params["energy_scale"] = torch.tensor(c)
    for weights in (
        LossWeights.make(1.0, 1.0, 0.5),
        LossWeights(LossTerm(1.0, "mae"), LossTerm(2.0, "huber", delta=0.1), LossTerm(0.5, reduction="sum")),
    ):
        loss_fn = make_loss(PET(config), weights)
        terms = [t for t in ("energy", "forces", "stress") if getattr(weights, t).weight > 0]

        def epoch_loss(size, pooled=True):
            sums = Sums(terms, weights if pooled else None)
            for start in range(0, len(samples), size):
                batch = make_batch(samples[start : start + size], config, w, c, torch.float64)
                sums.add(floats(loss_fn(params, batch)[1]))
            return sums.summary(c)["loss"]

        whole = float(loss_fn(params, make_batch(samples, config, w, c, torch.float64))[0])
        for size in (1, 2, 3, 7):
            assert epoch_loss(size) == pytest.approx(whole, rel=1e-12), (weights, size)
        assert abs(epoch_loss(2, pooled=False) / whole - 1) > 1e-3  # the mean of batch losses differs


def test_augmentation_does_not_depend_on_the_process(dataset):
    """A structure is rotated the same way in an epoch whichever process takes it:
    N processes with batch B see the batches of one process with N * B (the
    rotations were drawn per rank, and 1 and 2 processes trained models 7 % apart)."""
    import ase.io

    from petfunc import PETConfig
    from petfunc.data.samples import sample_from_atoms
    from petfunc.trainer import iterate_batches

    frames = ase.io.read(dataset, ":10")
    config = PETConfig(atomic_types=tuple(sorted({int(z) for a in frames for z in a.numbers})), **TINY_MODEL)
    samples = [sample_from_atoms(a, config) for a in frames]
    w, c = np.zeros(config.num_species), 1.0

    def rotated(batch_size, rank=0, world_size=1, epoch=1):
        out = {}
        for idx, batch in iterate_batches(
            samples,
            config,
            w,
            c,
            batch_size,
            epoch=epoch,
            seed=7,
            augment=True,
            dtype=torch.float64,
            rank=rank,
            world_size=world_size,
        ):
            offsets = np.cumsum([0] + [len(samples[i]) for i in idx])
            for k, i in enumerate(idx):
                out[int(i)] = batch.forces[offsets[k] : offsets[k + 1]].clone()
        return out

    one = rotated(4)
    two = {**rotated(2, 0, 2), **rotated(2, 1, 2)}
    assert sorted(one) == sorted(two) and len(one) == 8
    for i in one:
        assert torch.equal(one[i], two[i]), i
        assert not torch.allclose(one[i], torch.as_tensor(samples[i].forces)), i  # rotated
    assert not all(torch.equal(one[i], v) for i, v in rotated(4, epoch=2).items() if i in one)


def test_uneven_shards_cover_every_structure_once():
    # evaluation shards: no structure dropped, none repeated, a rank may get none
    for n, world in ((23, 2), (7, 3), (2, 4)):
        shards = [
            batch_plan(n, 4, shuffle=False, drop_last=False, rank=r, world_size=world, even_shards=False)
            for r in range(world)
        ]
        flat = np.concatenate([np.concatenate(s) if s else np.zeros(0, dtype=int) for s in shards])
        assert sorted(flat.tolist()) == list(range(n))
    assert batch_plan(2, 4, shuffle=False, drop_last=False, rank=3, world_size=4, even_shards=False) == []


def test_optimizer_state_roundtrip(tmp_path):
    params = {"a": torch.randn(3), "b": [torch.randn(2, 2)], "composition_weights": torch.zeros(2)}
    optimizer = make_optimizer(warmup_cosine(1e-3, 10), weight_decay=0.01)
    state = optimizer.init(trainable(params))
    # A state with non-zero entries: one update.
    grads = torch.utils._pytree.tree_map(torch.ones_like, trainable(params))
    _, state = optimizer.update(grads, state, params=trainable(params))
    plain = state_to_plain(state)
    assert_plain(plain)
    torch.save(plain, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    restored = state_from_plain(loaded, optimizer.init(trainable(params)))
    flat_a, spec_a = torch.utils._pytree.tree_flatten(state)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(restored)
    assert spec_a == spec_b and all(torch.equal(a, b) for a, b in zip(flat_a, flat_b))
    # A state that does not fit the optimizer is refused.
    with pytest.raises(ValueError, match="opt_state"):
        state_from_plain({"__namedtuple__": "Other"}, state)
    other = make_optimizer(warmup_cosine(1e-3, 10)).init({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="opt_state"):
        state_from_plain(plain, other)


def test_nan_stops_without_corrupting_checkpoints(dataset, tmp_path):
    good = fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.glob("*.ckpt")}
    # Continue with an absurd learning rate: the loss becomes inf/NaN.
    options = tiny_options(dataset, num_epochs=3, learning_rate=1e30, warmup_fraction=0.0)
    with pytest.raises(TrainingError, match=r"training loss is (nan|inf) at epoch 2"):
        fit(options, tmp_path, restart=tmp_path / "last.ckpt", progress=False, log=quiet())
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.glob("*.ckpt")}
    assert after == digests, "a checkpoint was overwritten by the diverged run"
    assert not list(tmp_path.glob(".*.tmp")), "temporary files left behind"
    config, params = load_model(tmp_path / "last.ckpt", which="last")
    assert all(torch.isfinite(t).all() for t in tree.flatten(params).values())
    assert params_equal(params, good.last_params)


def test_restart_removes_what_a_killed_run_left(dataset, tmp_path):
    fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    # what atomic_write leaves when SIGKILL comes between creating and renaming
    leftovers = [
        tmp_path / ".last.ckpt.k3j_x1.tmp",
        tmp_path / ".epoch_2.ckpt.a8.tmp",
        tmp_path / ".metrics.csv.zz.tmp",
    ]
    kept = tmp_path / ".notes.txt.tmp"  # not a name the trainer writes
    for path in leftovers + [kept]:
        path.write_bytes(b"partial")
    lines = []
    fit(
        tiny_options(dataset, num_epochs=2),
        tmp_path,
        restart=tmp_path / "last.ckpt",
        progress=False,
        log=lines.append,
    )
    assert not any(path.exists() for path in leftovers)
    assert kept.exists()
    assert any("removed 3 temporary file(s)" in line for line in lines)


def test_label_errors(dataset, tmp_path):
    # Forces asked for explicitly, under a key the file does not have.
    options = tiny_options(dataset)
    options["training_set"] = {
        "systems": str(dataset),
        "targets": {"energy": {"forces": {"key": "dft_forces"}}},
    }
    with pytest.raises(ValueError, match="dft_forces.*keys in the file"):
        fit(options, None, progress=False, log=quiet())
    # A forces weight in the loss with forces switched off in the data.
    options = tiny_options(dataset, loss={"energy": {"gradients": {"positions": {"weight": 10.0}}}})
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"forces": "auto"}}}
    energy_only = tmp_path / "energy_only.xyz"
    import ase.io

    frames = ase.io.read(dataset, ":")
    for atoms in frames:
        atoms.calc = type(atoms.calc)(atoms, energy=atoms.get_potential_energy())
    ase.io.write(energy_only, frames)
    options["training_set"]["systems"] = str(energy_only)
    with pytest.raises(ValueError, match="loss has a forces term"):
        fit(options, None, progress=False, log=quiet())
    # Wrong energy key.
    options = tiny_options(dataset)
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"key": "U0"}}}
    with pytest.raises(ValueError, match="'U0'"):
        fit(options, None, progress=False, log=quiet())
    # An energy of the wrong shape (a 3-vector under the key): named with the key
    # (was numpy's "cannot reshape array of size 3 into shape ()")
    frames = ase.io.read(dataset, ":")
    frames[2].calc.results["energy"] = np.array([1.0, 2.0, 3.0])
    bad = tmp_path / "vector.xyz"
    ase.io.write(bad, frames)
    with pytest.raises(
        ValueError,
        match=r"structure 2: the energy under the key 'energy' has shape \(3,\), "
        r"expected \(\) or \(1,\)",
    ):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    # Infinite labels.
    frames = ase.io.read(dataset, ":")
    frames[0].calc.results["energy"] = float("inf")
    bad = tmp_path / "inf.xyz"
    ase.io.write(bad, frames)
    with pytest.raises(ValueError, match="structure 0: the energy label is infinite"):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    # A stress label on a molecule (no cell volume): named before training starts; a
    # NaN stress there is the way to say "none" and trains
    frames = ase.io.read(dataset, ":")
    molecule = ase.Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    molecule.calc = type(frames[0].calc)(molecule, energy=1.0, forces=np.zeros((2, 3)), stress=np.zeros(6))
    ase.io.write(bad, frames + [molecule])
    with pytest.raises(
        ValueError, match=r"1 structure has a stress label but no cell volume: structure 16 \(pbc="
    ):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    slab = molecule.copy()
    slab.cell, slab.pbc = [3.0, 3.0, 0.0], [True, True, False]
    slab.calc = type(frames[0].calc)(slab, energy=1.0, forces=np.zeros((2, 3)), stress=np.zeros(6))
    ase.io.write(bad, [molecule] + frames + [slab])
    options = tiny_options(bad)
    options["validation_set"] = 0.0
    with pytest.raises(
        ValueError,
        match=r"2 structures have a stress label but no cell volume: structures 0 "
        r"\(pbc=\[False, False, False\]\), 17 \(pbc=\[True, True, False\]\)",
    ):
        fit(options, None, progress=False, log=quiet())
    molecule.calc.results["stress"] = np.full(6, np.nan)
    ase.io.write(bad, frames + [molecule])
    fit(tiny_options(bad, num_epochs=1), tmp_path / "nan_stress", progress=False, log=quiet())
    # Missing file.
    with pytest.raises(FileNotFoundError, match="not found"):
        fit(tiny_options(tmp_path / "nope.xyz"), None, progress=False, log=quiet())


def test_unknown_species_when_finetuning(dataset, tmp_path):
    import ase.io

    # A model trained on Cu/Ni/Al ...
    fit(tiny_options(dataset, num_epochs=1), tmp_path / "base", progress=False, log=quiet())
    # ... fine-tuned on data with gold.
    frames = ase.io.read(dataset, ":")
    frames[2].numbers[0] = 79
    gold = tmp_path / "gold.xyz"
    ase.io.write(gold, frames)
    options = tiny_options(gold, finetune={"read_from": str(tmp_path / "base" / "best.ckpt")})
    del options["architecture"]["model"]
    with pytest.raises(ValueError, match=r"atomic number\(s\) \[79\]"):
        fit(options, None, progress=False, log=quiet())


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda o: o.update(epochs=3), "unknown option 'epochs'"),
        (
            lambda o: o["architecture"]["training"].update(num_epoch=3),
            "'architecture.training.num_epoch'.*did you mean 'num_epochs'",
        ),
        (lambda o: o["architecture"]["model"].update(dpet=3), "'architecture.model.dpet'"),
        (
            lambda o: o.update(training_set={"systems": "x.xyz", "targets": {"energy": {"kye": "e"}}}),
            "'training_set.targets.energy.kye'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"wieght": 2}}),
            "'architecture.training.loss.energy.wieght'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"forces": {"weight": 2}}),
            r"'architecture.training.loss.forces': the forces loss is set under the energy target, as "
            r"'architecture.training.loss.energy.gradients.positions' \(or 'architecture.training.loss.energy.forces'\)",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"gradients": {"forces": 10}}}),
            r"metatrain names gradients 'positions' \(forces\) and 'strain'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"type": "mse", "delta": 0.3}}),
            r"'architecture.training.loss.energy.delta' is the threshold of the 'huber' loss; this term is 'mse'",
        ),
        (lambda o: o["architecture"]["training"].update(batch_size=0), "batch_size' must be positive"),
        (lambda o: o.update(base_precision=16), "base_precision"),
        (lambda o: o.update(validation_set=1.0), "validation_set"),
        (
            lambda o: o["architecture"]["training"].update(remat=True, compile=True),
            "'architecture.training.remat' and .*compile.* exclude",
        ),
        (
            lambda o: o["architecture"]["training"].update(remat="yes"),
            "'architecture.training.remat' must be true or false",
        ),
        (
            lambda o: o["architecture"]["training"].update(deterministic="yes"),
            "'architecture.training.deterministic' must be true, false or null",
        ),
    ],
)
def test_bad_options(change, message):
    options = tiny_options("data.xyz")
    change(options)
    with pytest.raises(ValueError, match=message):
        resolve_options(options)


def test_options_defaults_and_loss_forms():
    options = resolve_options(
        {"training_set": "data.xyz", "architecture": {"name": "pet", "training": {"num_workers": 4}}}
    )
    training = options["architecture"]["training"]
    # metatrain's PET trainer defaults.
    assert (training["batch_size"], training["num_epochs"], training["learning_rate"]) == (16, 1000, 1e-4)
    assert training["augmentation"] is True and training["compile"] is False
    assert training["best_model_metric"] == "mae_prod" and "num_workers" not in training
    # metatrain's top-level logging keys: accepted, ignored (wandb with a warning)
    logging_keys = resolve_options({"training_set": "data.xyz", "print_stats": True, "final_eval": False})
    assert "print_stats" not in logging_keys and "final_eval" not in logging_keys
    with pytest.warns(UserWarning, match="does not log to Weights & Biases"):
        resolve_options({"training_set": "data.xyz", "wandb": {"project": "x"}})
    # one energy target of another name (metatrain's mtt::NAME; its key is the name by default)
    named = resolve_options(
        {"training_set": {"systems": "data.xyz", "targets": {"mtt::U0": {"unit": "kcal/mol"}}}}
    )
    assert named["training_set"]["targets"]["energy"]["key"] == "mtt::U0"
    assert named["training_set"]["targets"]["energy"]["unit"] == "kcal/mol"
    # as in metatrain: no forces or stress by default for such a target without an
    # explicit 'quantity: energy', and its loss keyed by its name
    assert named["training_set"]["targets"]["energy"]["forces"] is False
    assert named["training_set"]["targets"]["energy"]["stress"] is False
    explicit = resolve_options(
        {
            "training_set": {"systems": "data.xyz", "targets": {"mtt::U0": {"quantity": "energy"}}},
            "architecture": {"training": {"loss": {"mtt::U0": "mae"}}},
        }
    )
    assert explicit["training_set"]["targets"]["energy"]["forces"] == "auto"
    assert explicit["architecture"]["training"]["loss"] == {"energy": "mae"}
    with pytest.raises(ValueError, match=r"unknown option 'training_set.targets.mtt::U0'"):
        resolve_options({"training_set": {"systems": "data.xyz", "targets": {"energy": {}, "mtt::U0": {}}}})
    assert options["training_set"]["targets"]["energy"]["forces"] == "auto"
    assert options["validation_set"] == 0.1
    # metatrain's deprecated 'distributed': false is fine; true needs several processes
    training = {"distributed": False, "distributed_port": 1234}
    resolve_options({"training_set": "data.xyz", "architecture": {"name": "pet", "training": training}})
    with pytest.raises(ValueError, match="must be true or false"):
        resolve_options({"training_set": "data.xyz", "architecture": {"training": {"distributed": "yes"}}})
    distributed = {"training_set": "missing.xyz", "architecture": {"training": {"distributed": True}}}
    with pytest.raises(ValueError, match="is true, but this is one process"):
        fit(distributed, None, progress=False, log=quiet())
    with pytest.raises(FileNotFoundError):  # two ranks: past that check, to the data
        fit(
            distributed,
            None,
            progress=False,
            log=quiet(),
            world_size=2,
            reduce_grads=lambda g: g,
            reduce_metrics=lambda m: m,
        )
    weights, explicit = parse_loss(
        {"energy": {"type": "mae", "gradients": {"positions": {"weight": 10}}, "stress": 0.5}}
    )
    # metatrain: the energy type does not carry over to the gradient terms
    assert (weights.energy.type, weights.forces.weight, weights.forces.type, weights.stress.weight) == (
        "mae",
        10.0,
        "mse",
        0.5,
    )
    assert explicit == {"forces", "stress"}
    weights, explicit = parse_loss("huber")
    assert weights.stress.type == "huber" and explicit == set()
    weights, _ = parse_loss(
        {"energy": {"type": "huber", "delta": 0.1, "forces": {"type": "huber", "delta": 0.3}}}
    )
    assert (weights.energy.delta, weights.forces.delta, weights.stress.type) == (0.1, 0.3, "mse")
    with pytest.raises(ValueError, match="delta"):
        parse_loss({"energy": {"type": "huber", "delta": -1.0}})


LOSS_FORMS = [
    None,
    "huber",
    "mae",
    {"energy": "huber"},
    {"energy": {"type": "mae", "gradients": {"positions": {"weight": 10}}}},
    {"energy": {"type": "huber", "delta": 0.1, "forces": {"type": "huber", "delta": 0.3}}},
    {"energy": {"weight": 2.0, "forces": "mae", "virial": {"weight": 0.5}}},
    {"energy": {"gradients": {"positions": "huber", "strain": {"type": "mae", "weight": 3.0}}}},
    {"energy": {"reduction": "sum", "forces": {"reduction": "sum", "weight": 2.0}}},
    {"energy": {"type": "huber", "gradients": {"strain": {"reduction": "sum"}}}},
]


@pytest.mark.parametrize("form", LOSS_FORMS, ids=[str(f) for f in LOSS_FORMS])
def test_loss_options_expand_like_metatrain(form):
    """Every term's type, weight, Huber delta and reduction as metatrain's
    expand_loss_config gives them, for an energy target with forces and stress."""
    pytest.importorskip("metatrain")
    from metatrain.utils.omegaconf import expand_loss_config
    from omegaconf import OmegaConf

    targets = {"energy": {"quantity": "energy", "forces": {"key": "forces"}, "stress": {"key": "stress"}}}
    conf = OmegaConf.create(
        {"training_set": [{"targets": targets}], "architecture": {"training": {"loss": form}}}
    )
    expanded = OmegaConf.to_container(expand_loss_config(conf)["architecture"]["training"]["loss"])["energy"]
    weights, _ = parse_loss(form if form is not None else {})
    reference = {
        "energy": expanded,
        "forces": expanded["gradients"]["positions"],
        "stress": expanded["gradients"]["strain"],
    }
    for name, ref in reference.items():
        term = getattr(weights, name)
        assert (term.type, term.weight, term.delta, term.reduction) == (
            ref["type"],
            ref["weight"],
            ref.get("delta", 1.0),
            ref.get("reduction", "mean"),
        ), name


@pytest.mark.slow
def test_compiled_fit_matches_eager(dataset):
    # compile: true with the quick aot_eager backend, float64: the same training as
    # eager, and no recompilation across the differently sized batches.
    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    eager = fit(options, None, progress=False, log=quiet())
    options["architecture"]["training"].update(compile=True, compile_backend="aot_eager")
    compiled = fit(options, None, progress=False, log=quiet())
    from torch._dynamo.utils import guard_failures

    reasons = {getattr(code, "co_name", str(code)): r for code, r in guard_failures.items()}
    assert compiled.compiled_graphs == {"train": 1, "eval": 1}, f"recompilations: {reasons}"
    a, b = tree.flatten(eager.last_params), tree.flatten(compiled.last_params)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-12, msg=key)
    for row_e, row_c in zip(eager.history, compiled.history):
        assert math.isclose(row_e["val_loss"], row_c["val_loss"], rel_tol=1e-9)


@pytest.mark.slow
def test_compiled_fit_reuses_its_trace(dataset, tmp_path, monkeypatch):
    # a second identical run loads the trace (petfunc.compile's cache) and trains
    # bit for bit the same; another learning rate traces afresh
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    options = tiny_options(dataset, num_epochs=1, compile=True, compile_backend="aot_eager")
    runs = []
    for learning_rate in (1e-2, 1e-2, 2e-2):
        options["architecture"]["training"]["learning_rate"] = learning_rate
        lines = []
        runs.append((fit(copy.deepcopy(options), None, progress=False, log=quiet(lines)), lines))
    cached = [any("loaded the cached trace" in line for line in lines) for _, lines in runs]
    assert cached == [False, True, False]
    assert params_equal(runs[0][0].last_params, runs[1][0].last_params)
    assert not params_equal(runs[0][0].last_params, runs[2][0].last_params)


def test_finetune_from_metatrain_checkpoint(tmp_path):
    # A tiny metatrain PET (types H, C, N, O; d_pet=1) fine-tuned on EMT molecules.
    metatrain_pet = pytest.importorskip("metatrain.pet")
    import os

    import ase.build
    import ase.io
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    from petfunc.io import from_metatrain

    checkpoint = os.path.join(
        os.path.dirname(metatrain_pet.__file__), "tests", "checkpoints", "model-v16_trainer-v15.ckpt.gz"
    )
    frames = []
    for i, name in enumerate(["CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H6"] * 2):
        atoms = ase.build.molecule(name)
        atoms.rattle(0.05, seed=i)
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(
            atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces()
        )
        frames.append(atoms)
    ase.io.write(tmp_path / "molecules.xyz", frames)
    options = {
        "architecture": {
            "name": "pet",
            "training": {"batch_size": 4, "num_epochs": 1, "finetune": {"read_from": checkpoint}},
        },
        "training_set": str(tmp_path / "molecules.xyz"),
        "validation_set": 0.25,
    }
    result = fit(options, None, progress=False, log=quiet())
    config, start = from_metatrain(checkpoint)
    assert result.config == config
    # Trained from the checkpoint's weights; its composition and scale kept, as
    # metatrain keeps those of a target the model has.
    moved = [
        k
        for k, v in tree.flatten(trainable(start)).items()
        if not torch.equal(v, tree.flatten(result.last_params)[k])
    ]
    assert moved, "no parameter changed"
    assert torch.equal(result.params["composition_weights"], start["composition_weights"])
    assert torch.equal(result.params["energy_scale"], start["energy_scale"])
    # Options may not redefine the architecture when fine-tuning; as in metatrain, the
    # keys they give must match the checkpoint's (an unchanged options file works).
    from petfunc.trainer import check_model_section

    check_model_section(
        {"d_pet": config.d_pet, "cutoff": config.cutoff, "normalization": config.normalization.lower()},
        config,
        "it",
    )
    options["architecture"]["model"] = {"cutoff": config.cutoff + 0.5, "num_heads": config.num_heads}
    with pytest.raises(
        ValueError, match=r"differs from the architecture of the fine-tuning checkpoint .*\(cutoff: "
    ):
        fit(options, None, progress=False, log=quiet())


def test_long_range_training(dataset, tmp_path):
    """A model with long-range features trains (Ewald batches), its weights move, and
    the checkpoint evaluates (P3M) with the errors the trainer reported."""
    options = tiny_options(dataset)
    options["architecture"]["model"]["long_range"] = {"enable": True, "kspace_resolution": 1.0}
    lines = []
    fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    config, params = load_model(tmp_path / "run" / "best.ckpt")
    assert config.long_range.enable and config.long_range.kspace_resolution == 1.0
    fresh = PET(config).init(seed=options["seed"], dtype=torch.float32)
    key = "long_range_featurizer.charges_map.weight"
    assert not torch.allclose(tree.flatten(params)[key], tree.flatten(fresh)[key])
    assert main(["eval", str(tmp_path / "run" / "best.ckpt"), str(dataset)]) == 0


def test_charge_and_spin_conditioned_training(dataset, tmp_path):
    """metatrain's ``extra_data`` section names the info keys of the charge and spin
    multiplicity; the conditioning gate (zero at init) learns from them."""
    import ase.io

    frames = ase.io.read(dataset, ":")
    for i, atoms in enumerate(frames):
        atoms.info["q"] = i % 3 - 1
        atoms.info["mult"] = 1 + i % 2
    path = tmp_path / "charged.xyz"
    ase.io.write(path, frames)
    options = tiny_options(path)
    options["architecture"]["model"].update(system_conditioning=True, max_charge=2, max_spin_multiplicity=3)
    options["training_set"] = {
        "systems": str(path),
        "extra_data": {"charge": {"key": "q"}, "spin_multiplicity": {"key": "mult"}},
    }
    fit(options, tmp_path / "run", progress=False, log=quiet())
    config, params = load_model(tmp_path / "run" / "best.ckpt")
    assert config.system_conditioning and config.max_charge == 2
    gate = tree.flatten(params)["system_conditioning.project.2.weight"]
    assert gate.abs().max() > 0
    from petfunc.data import read_labelled

    samples = read_labelled(path, config, charge_key="q", spin_multiplicity_key="mult")
    assert [s.structure.charge for s in samples[:4]] == [-1, 0, 1, -1]
    assert [s.structure.spin_multiplicity for s in samples[:3]] == [1, 2, 1]
    with pytest.raises(ValueError, match="charge_key: no structure .* has the info key 'Q'"):
        read_labelled(path, config, charge_key="Q")

    options["training_set"]["extra_data"]["charge"]["key"] = "total_charge"
    with pytest.raises(
        ValueError, match=r"training_set.extra_data.charge: no structure .* has the info key 'total_charge'"
    ):
        fit(options, None, progress=False, log=quiet())
    frames[3].info["q"] = 5
    ase.io.write(path, frames)
    options["training_set"]["extra_data"]["charge"]["key"] = "q"
    with pytest.raises(ValueError, match=r"structure 3: charge 5 is outside the model's range \[-2, 2\]"):
        fit(options, None, progress=False, log=quiet())


def test_validation_fraction_below_one_structure(dataset):
    """As in metatrain: floor(16 * 0.05) = 0 validation structures, with a warning;
    the run trains and reports training metrics."""
    lines = []
    result = fit(
        tiny_options(dataset, num_epochs=1) | {"validation_set": 0.05}, None, progress=False, log=quiet(lines)
    )
    assert any("is less than one; none of them is used for validation" in line for line in lines), lines
    assert any("training set: 16 structures" in line for line in lines), lines
    assert result.best_epoch == 1


def test_read_dataset(dataset, tmp_path):
    """petfunc.read_dataset: labels as in the file (eV, eV/Å), a slice, clear errors."""
    import ase.io

    import petfunc

    frames = ase.io.read(dataset, ":")
    config = petfunc.PETConfig(atomic_types=(13, 28, 29), **TINY_MODEL)
    data = petfunc.read_dataset(dataset, config)
    assert len(data.samples) == len(frames) == 16
    assert data.samples[3].energy == frames[3].get_potential_energy()
    np.testing.assert_array_equal(data.samples[3].forces, frames[3].get_forces())
    assert len(petfunc.read_dataset(dataset, config, index="2:5").samples) == 3
    with pytest.raises(FileNotFoundError, match="dataset: dataset file not found: .*nope.xyz"):
        petfunc.read_dataset(tmp_path / "nope.xyz", config)
    (tmp_path / "bad.xyz").write_text("not an xyz file\n")
    with pytest.raises(ValueError, match="could not read dataset file"):
        petfunc.read_dataset(tmp_path / "bad.xyz", config)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float32_runs_repeat_exactly(dataset, compiled):
    """Two float32 runs with the same options give bitwise the same model. With two
    threads, torch's float32 ``index_put_(accumulate=True)`` (the adjoint of every
    gather in the eager step; the traced step's scatter-adds with aot_eager) adds with
    atomics in thread order; ``deterministic`` (the default on CPU) fixes the order.
    The setting is restored after ``fit``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        extra = {"compile": True, "compile_backend": "aot_eager"} if compiled else {}
        options = tiny_options(dataset, num_epochs=2, batch_size=8, **extra)
        options["architecture"]["model"].update(cutoff=5.0)
        runs = [fit(options, None, progress=False, log=quiet()) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert not torch.are_deterministic_algorithms_enabled()
    assert params_equal(runs[0].last_params, runs[1].last_params)
    assert [r["train_loss"] for r in runs[0].history] == [r["train_loss"] for r in runs[1].history]


def test_partial_model_section_is_checked_against_the_checkpoint(dataset):
    """A fine-tuning or restart options file may name a few model keys; the keys it
    omits come from the checkpoint, so relations such as d_pet % num_heads are checked
    there, not against the defaults ({d_pet: 4} fails with the default num_heads 8 but
    suits a checkpoint with num_heads 2)."""
    from petfunc.config import PETConfig
    from petfunc.trainer import check_model_section

    config = PETConfig(atomic_types=(13, 28, 29), **{**TINY_MODEL, "d_pet": 4, "num_heads": 2})
    options = tiny_options(dataset)
    options["architecture"]["model"] = {"d_pet": 4, "cutoff_width": 0.5}
    resolve_options(
        options
    )  # each value is fine; d_pet 4 against the default num_heads 8 is not checked here
    check_model_section({"d_pet": 4, "cutoff_width": 0.5}, config, "it")
    with pytest.raises(
        ValueError, match=r"d_pet must be divisible by num_heads, got d_pet=4 and num_heads=3"
    ):
        check_model_section({"num_heads": 3}, config, "it")
    # relations among the keys given are still checked by the options
    options["architecture"]["model"] = {"d_pet": 4, "num_heads": 3}
    with pytest.raises(ValueError, match=r"option 'architecture.model': d_pet must be divisible"):
        resolve_options(options)
    options["architecture"]["model"] = {"num_gnn_layers": 0, "featurizer_type": "residual"}
    with pytest.raises(
        ValueError, match=r"option 'architecture.model': num_gnn_layers 0 needs featurizer_type"
    ):
        resolve_options(options)
    options["architecture"]["model"] = {"d_pet": 0}
    with pytest.raises(ValueError, match=r"option 'architecture.model': d_pet must be a positive integer"):
        resolve_options(options)
    # a fresh model fills the omitted keys with the defaults, and names the relation
    options["architecture"]["model"] = {"d_pet": 4}
    with pytest.raises(
        ValueError,
        match=r"option 'architecture.model': d_pet must be divisible by num_heads, got d_pet=4 and num_heads=8",
    ):
        fit(options, None, progress=False, log=quiet())


def test_lengths_in_other_units_are_announced(dataset, tmp_path):
    """Data in bohr: converted to Å with the architecture's lengths in Å, which
    metatrain (training in the data's unit) does not do: the log says so."""
    import ase.io

    frames = ase.io.read(dataset, ":8")
    bohr = 0.5291772105448199
    for atoms in frames:
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = None
        atoms.set_cell(atoms.cell[:] / bohr, scale_atoms=True)
        atoms.info["E"] = energy
        atoms.arrays["F"] = forces * bohr
    ase.io.write(tmp_path / "bohr.xyz", frames)
    options = tiny_options(dataset, num_epochs=1)
    options["training_set"] = {
        "systems": {"read_from": str(tmp_path / "bohr.xyz"), "length_unit": "bohr"},
        "targets": {"energy": {"key": "E", "forces": {"key": "F"}, "stress": False}},
    }
    lines = []
    fit(options, None, progress=False, log=quiet(lines))
    assert any(
        line.startswith("note: lengths in bohr are converted to Å") and "cutoff 3" in line for line in lines
    ), lines
    lines.clear()
    fit(tiny_options(dataset, num_epochs=1), None, progress=False, log=quiet(lines))
    assert not any("converted to Å" in line for line in lines)


def test_explicit_indices_equal_mtt_train(tmp_path):
    """metatrain's ``indices``: a training subset split by fractions, and
    validation/test sets given as indices into the training file. Regression values:
    indices/{training,validation,test}.txt of ``mtt train`` (metatrain 2026.4.1,
    seed 7, 21 structures) with the same options."""
    from petfunc.trainer.datasets import read_training_files
    from petfunc.trainer.options import parse_loss

    data = make_default_dataset(tmp_path / "data.xyz", n_structures=21, seed=1)
    subset = [20, 3, 5, 7, 9, 11, 13, 15, 2, 0, 1, 18, 17, 16]
    (tmp_path / "subset.txt").write_text("\n".join(map(str, subset)) + "\n")

    def split(**options):
        resolved = resolve_options(
            {"seed": 7, "training_set": {"systems": str(data), "indices": subset}, **options}
        )
        weights, explicit = parse_loss(resolved["architecture"]["training"]["loss"])
        split = read_training_files(resolved, weights, explicit, 7, None, quiet()).split
        for key in ("digests", "validation_digests", "test_digests"):
            split.pop(key)
        return split

    assert split(validation_set=0.3, test_set=0.2) == {
        "training": [[18, 11, 5, 3, 1, 17, 20, 16]],
        "validation": [[7, 13, 0, 9]],
        "test": [[2, 15]],
    }
    assert split(validation_set={"indices": [4, 6, 8]}, test_set={"indices": str(tmp_path / "subset.txt")})[
        "test"
    ] == [subset]
    assert split(validation_set={"indices": [4, 6, 8]}, test_set={"indices": [10, 12, 14, 19]}) == {
        "training": [subset],
        "validation": [[4, 6, 8]],
        "test": [[10, 12, 14, 19]],
    }
    with pytest.raises(
        ValueError, match=r"option 'validation_set.indices': index 21 is out of range for a file of 21"
    ):
        split(validation_set={"indices": [21]})
    with pytest.raises(ValueError, match=r"option 'training_set.indices': indices must not repeat"):
        resolve_options({"training_set": {"systems": str(data), "indices": [1, 1]}})
    with pytest.raises(ValueError, match=r"indices alone need a single training dataset"):
        resolve_options({"training_set": [str(data), str(data)], "validation_set": {"indices": [1]}})
    # a run and its restart keep the split
    options = tiny_options(data, num_epochs=1)
    options["training_set"] = {"systems": str(data), "indices": subset}
    options["validation_set"] = {"indices": [4, 6, 8]}
    first = fit(options, tmp_path / "run", progress=False, log=quiet())
    stored = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    assert stored["validation"] == [[4, 6, 8]] and sorted(stored["training"][0]) == sorted(subset)
    options["architecture"]["training"]["num_epochs"] = 2
    again = fit(
        options, tmp_path / "again", restart=tmp_path / "run" / "last.ckpt", progress=False, log=quiet()
    )
    assert read_checkpoint(tmp_path / "again" / "last.ckpt")["split"] == stored
    assert first.history[0]["val_loss"] == again.history[0]["val_loss"]
    options["validation_set"] = {"indices": [4, 6]}  # a restart cannot change its split
    with pytest.raises(
        ValueError, match=r"option 'validation_set' is indices \[4, 6\] here, indices \[4, 6, 8\]"
    ):
        fit(options, tmp_path / "third", restart=tmp_path / "run" / "last.ckpt", progress=False, log=quiet())


def test_restart_with_other_steps_per_epoch_ends_the_schedule(dataset, tmp_path):
    """A restart that takes another number of steps per epoch (another number of
    processes, batch packing or batch size): the learning rate still decays to the
    end of the run (the schedule's length was recomputed from the new steps per
    epoch only, so it ran out early, or stopped short of zero), with a warning."""
    options = tiny_options(dataset, num_epochs=2, batch_size=4, warmup_fraction=0.0)
    fit(options, tmp_path / "first", progress=False, log=quiet())
    options["architecture"]["training"].update(num_epochs=4, batch_size=2)
    lines = []
    result = fit(
        options,
        tmp_path / "second",
        restart=tmp_path / "first" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any("fitted to end with epoch 4" in line for line in lines), lines
    rates = [row["learning_rate"] for row in result.history]
    peak = options["architecture"]["training"]["learning_rate"]
    assert rates[2] > 0.1 * peak and 0 < rates[3] < 0.05 * peak, rates


@pytest.mark.parametrize("compile_on", [False, True], ids=["eager", "aot_eager"])
def test_best_model_metric_counts_terms_of_weight_zero(dataset, compile_on):
    """metatrain's mae_prod multiplies the errors of every labelled quantity, whatever
    its loss weight: a forces term of weight 0 was left out of petfunc's product (and
    of its validation columns), so another best epoch could be picked."""
    options = tiny_options(
        dataset,
        num_epochs=1,
        loss={"energy": {"forces": {"weight": 0}}},
        compile=compile_on,
        compile_backend="aot_eager",
    )
    result = fit(options, None, progress=False, log=quiet())
    row = result.history[-1]
    assert "train_forces_mae" not in row  # no forces are computed in the training step
    product = row["val_energy_mae"] * row["val_forces_mae"] * row["val_stress_mae"]
    assert row["selection_metric"] == pytest.approx(product, rel=1e-12)
    # the loss itself has no forces term: that of the same run with the term dropped
    without = {**options, "training_set": {"systems": str(dataset), "targets": {"energy": {"forces": False}}}}
    dropped = fit(without, None, progress=False, log=quiet())
    assert "val_forces_mae" not in dropped.history[-1]
    assert dropped.history[-1]["val_loss"] == pytest.approx(row["val_loss"], rel=1e-12)
