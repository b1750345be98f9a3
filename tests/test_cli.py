"""The ``petfunc`` command: demo training end to end, restart, eval, errors."""

import csv
import importlib.metadata
import json

import pytest
import torch
import yaml

from petfunc.cli import main, make_default_dataset
from petfunc.trainer import evaluate


TINY = [
    "--set",
    "architecture.model.d_pet=8",
    "--set",
    "architecture.model.d_head=8",
    "--set",
    "architecture.model.d_node=8",
    "--set",
    "architecture.model.d_feedforward=8",
    "--set",
    "architecture.model.num_heads=2",
    "--set",
    "architecture.model.num_gnn_layers=1",
    "--set",
    "architecture.model.cutoff=3.0",
    "--batch-size",
    "4",
    "--no-progress",
]


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    """``petfunc train`` without an options file (built-in dataset), tiny model, 1 epoch."""
    out = tmp_path_factory.mktemp("demo")
    code = main(["train", "--output", str(out), "--structures", "16", "--epochs", "1", *TINY])
    assert code == 0
    return out


def test_demo_train_writes_everything(demo_run):
    for name in (
        "dataset.xyz",
        "options.yaml",
        "last.ckpt",
        "best.ckpt",
        "best_params.pt",
        "metrics.csv",
        "parity.png",
    ):
        assert (demo_run / name).is_file(), f"{name} missing"
    assert (demo_run / "parity.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = list(csv.DictReader(open(demo_run / "metrics.csv")))
    assert len(rows) == 1 and float(rows[0]["val_forces_rmse"]) > 0
    options = yaml.safe_load(open(demo_run / "options.yaml"))
    assert options["architecture"]["model"]["d_pet"] == 8
    assert options["training_set"]["systems"]["read_from"].endswith("dataset.xyz")
    ckpt = torch.load(demo_run / "last.ckpt", weights_only=True)
    assert ckpt["epoch"] == 1


def test_restart_continues(demo_run, tmp_path, capsys):
    out = tmp_path / "more"
    code = main(
        [
            "train",
            "--restart",
            str(demo_run / "last.ckpt"),
            "--epochs",
            "2",
            "--output",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 0, capsys.readouterr().err
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert torch.load(out / "last.ckpt", weights_only=True)["epoch"] == 2
    # fewer epochs than the checkpoint has done: an error, and the folder as it was
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    assert main(["train", "--restart", str(out / "last.ckpt"), "--epochs", "1", "--no-progress"]) == 2
    assert "at epoch 2 and num_epochs is 1: ask for at least as many epochs" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_sigterm_puts_the_folder_back(demo_run, tmp_path):
    """SIGTERM (a scheduler; torchrun stopping the other processes when one fails)
    before the first checkpoint: exit 143, and the folder as it was, as with Ctrl-C.
    The signal is sent by the process itself when fit starts (options.yaml written)."""
    import os
    import shutil
    import subprocess
    import sys

    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import os, signal\n"
        "import petfunc.cli.train as command\n"
        "original = command.fit\n"
        "def fit(*args, **kwargs):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    return original(*args, **kwargs)\n"
        "command.fit = fit\n"
    )
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(hook), os.environ.get("PYTHONPATH", "")]),
        OMP_NUM_THREADS="1",
    )
    folder = tmp_path / "run"
    shutil.copytree(demo_run, folder)
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    command = [sys.executable, "-m", "petfunc", "train", "--no-progress"]
    done = subprocess.run(
        command + ["--restart", str(folder / "last.ckpt"), "--epochs", "3", "--lr", "1e-4"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 143 and "petfunc: terminated" in done.stderr, done.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # options.yaml put back
    done = subprocess.run(
        command + ["--structures", "8", "-o", str(tmp_path / "fresh" / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 143, done.stderr[-2000:]
    assert not (tmp_path / "fresh").exists()


def test_diverging_run_exits_with_1(demo_run, tmp_path, capsys):
    args = [
        "train",
        "--restart",
        str(demo_run / "last.ckpt"),
        "--output",
        str(tmp_path),
        "--epochs",
        "3",
        "--lr",
        "1e30",
        "--set",
        "architecture.training.warmup_fraction=0",
        "--no-progress",
    ]
    assert main(args) == 1
    err = capsys.readouterr().err
    assert "training stopped" in err and "learning rate" in err
    assert not (tmp_path / "last.ckpt").exists()


def test_eval(demo_run, capsys):
    capsys.readouterr()
    code = main(
        [
            "eval",
            str(demo_run / "best.ckpt"),
            str(demo_run / "dataset.xyz"),
            "--json",
            str(demo_run / "m.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "16 structures" in out
    for name in ("energy/atom", "forces", "stress", "eV/atom", "RMSE", "MAE"):
        assert name in out, out
    metrics = json.loads((demo_run / "m.json").read_text())
    assert metrics["forces_count"] == 3 * metrics["n_atoms"] and metrics["energy_per_atom_rmse"] > 0


def test_eval_writes_predictions(demo_run, tmp_path, capsys):
    """``petfunc eval --output``: one frame per structure with the predicted energy,
    forces and (periodic cells only) stress, equal to the calculator's."""
    import ase.build
    import ase.io
    import numpy as np

    from petfunc.ase.calculator import PETCalculator
    from petfunc.io import load_model

    frames = ase.io.read(demo_run / "dataset.xyz", ":3")
    molecule = ase.Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    dataset = tmp_path / "mixed.xyz"
    ase.io.write(dataset, frames + [molecule])
    out = tmp_path / "predictions.xyz"
    assert main(["eval", str(demo_run / "best.ckpt"), str(dataset), "-o", str(out)]) == 0
    assert f"predictions written to {out}" in capsys.readouterr().out
    predicted = ase.io.read(out, ":")
    assert len(predicted) == 4
    config, params = load_model(demo_run / "best.ckpt")
    for atoms, reference in zip(predicted, frames + [molecule]):
        np.testing.assert_array_equal(atoms.numbers, reference.numbers)
        np.testing.assert_allclose(atoms.positions, reference.positions, atol=1e-8)
        reference = reference.copy()
        reference.calc = PETCalculator(config, params)
        assert atoms.get_potential_energy() == pytest.approx(reference.get_potential_energy(), rel=1e-5)
        np.testing.assert_allclose(atoms.get_forces(), reference.get_forces(), rtol=1e-4, atol=1e-5)
        if reference.pbc.all():
            np.testing.assert_allclose(atoms.get_stress(), reference.get_stress(), rtol=1e-4, atol=1e-6)
    assert "stress" not in predicted[3].calc.results
    # a file without labels: predictions only (as mtt eval without targets)
    bare = tmp_path / "bare.xyz"
    ase.io.write(bare, [atoms.copy() for atoms in frames])
    assert main(["eval", str(demo_run / "best.ckpt"), str(bare)]) == 2
    assert "has no labels" in capsys.readouterr().err
    assert main(["eval", str(demo_run / "best.ckpt"), str(bare), "-o", str(tmp_path / "bare_out.xyz")]) == 0
    assert "no labels in the file: predictions only" in capsys.readouterr().out
    bare_predicted = ase.io.read(tmp_path / "bare_out.xyz", ":")
    for atoms, reference in zip(bare_predicted, predicted):
        assert atoms.get_potential_energy() == reference.get_potential_energy()
    # a file read in kcal/mol and bohr gets its predictions in those units
    from ase.units import Bohr, kcal, mol

    scaled = []
    for atoms in frames:
        atoms = atoms.copy()
        atoms.set_cell(atoms.cell / Bohr, scale_atoms=True)
        scaled.append(atoms)
    ase.io.write(tmp_path / "bohr.xyz", scaled)
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(tmp_path / "bohr.xyz"),
                "-o",
                str(tmp_path / "bohr_out.xyz"),
                "--energy-unit",
                "kcal/mol",
                "--length-unit",
                "bohr",
            ]
        )
        == 0
    )
    for atoms, reference, original in zip(ase.io.read(tmp_path / "bohr_out.xyz", ":"), predicted, scaled):
        np.testing.assert_allclose(atoms.positions, original.positions, atol=1e-7)
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy() * mol / kcal, rel=1e-6
        )
        np.testing.assert_allclose(
            atoms.get_forces(), reference.get_forces() * Bohr * mol / kcal, rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(
            atoms.get_stress(), reference.get_stress() * Bohr**3 * mol / kcal, rtol=1e-4, atol=1e-6
        )


def test_eval_reads_virials(demo_run, tmp_path, capsys):
    """``--virial-key``: virial labels W are compared as the stress -W/V, so a file of
    virials gives the stress errors of the same file with stresses."""
    import ase.io
    import numpy as np
    from ase.stress import voigt_6_to_full_3x3_stress

    frames = ase.io.read(demo_run / "dataset.xyz", ":4")
    with_virials = []
    for atoms in frames:
        copy = atoms.copy()
        copy.info["energy"] = atoms.get_potential_energy()
        copy.arrays["forces"] = atoms.get_forces()
        copy.info["virial"] = -voigt_6_to_full_3x3_stress(atoms.get_stress()) * atoms.get_volume()
        with_virials.append(copy)
    ase.io.write(tmp_path / "virials.xyz", with_virials)
    json_s, json_w = tmp_path / "s.json", tmp_path / "w.json"
    ase.io.write(tmp_path / "stresses.xyz", frames)
    assert (
        main(["eval", str(demo_run / "best.ckpt"), str(tmp_path / "stresses.xyz"), "--json", str(json_s)])
        == 0
    )
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(tmp_path / "virials.xyz"),
                "--virial-key",
                "virial",
                "--json",
                str(json_w),
            ]
        )
        == 0
    )
    stress, virial = json.loads(json_s.read_text()), json.loads(json_w.read_text())
    assert virial["stress_count"] == stress["stress_count"] == 4 * 9
    np.testing.assert_allclose(virial["stress_rmse"], stress["stress_rmse"], rtol=1e-6)


def test_eval_reads_labels_as_the_model_was_trained(demo_run, tmp_path, capsys):
    """A model trained on other keys and units is evaluated on them by default."""
    import ase.io
    import ase.units

    frames = ase.io.read(demo_run / "dataset.xyz", ":12")
    renamed = []
    for atoms in frames:
        copy = atoms.copy()
        copy.info["U0"] = atoms.get_potential_energy() / (ase.units.kcal / ase.units.mol)
        copy.arrays["F"] = atoms.get_forces() / (ase.units.kcal / ase.units.mol)
        renamed.append(copy)
    ase.io.write(tmp_path / "kcal.xyz", renamed)
    options = tmp_path / "options.yaml"
    options.write_text(
        f"training_set:\n  systems: {tmp_path / 'kcal.xyz'}\n  targets:\n    energy:\n      key: U0\n"
        "      unit: kcal/mol\n      forces: {key: F}\n      stress: false\nvalidation_set: 0.25\n"
    )
    assert main(["train", str(options), "--output", str(tmp_path / "run"), "--epochs", "1", *TINY]) == 0
    capsys.readouterr()
    model = str(tmp_path / "run" / "best.ckpt")
    assert main(["eval", model, str(tmp_path / "kcal.xyz"), "--json", str(tmp_path / "a.json")]) == 0
    assert (
        "labels read as the model was trained: energy key 'U0', forces key 'F', energy unit 'kcal/mol'"
        in capsys.readouterr().out
    )
    ase.io.write(tmp_path / "ev.xyz", frames)
    assert (
        main(
            [
                "eval",
                model,
                str(tmp_path / "ev.xyz"),
                "--energy-key",
                "energy",
                "--forces-key",
                "forces",
                "--energy-unit",
                "eV",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert a["forces_count"] == b["forces_count"] > 0 and "stress_rmse" not in a
    for key in ("energy_per_atom_rmse", "forces_rmse", "forces_mae"):
        assert a[key] == pytest.approx(b[key], rel=1e-6)


def test_eval_errors(demo_run, tmp_path, capsys):
    assert main(["eval", str(demo_run / "best.ckpt"), str(tmp_path / "missing.xyz")]) == 2
    assert "not found" in capsys.readouterr().err
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is not\nan xyz file\n")
    assert main(["eval", str(demo_run / "best.ckpt"), str(garbage)]) == 2
    assert "could not read dataset file" in capsys.readouterr().err
    assert main(["eval", str(garbage), str(demo_run / "dataset.xyz")]) == 2
    assert "error" in capsys.readouterr().err
    # a checkpoint cut short (an interrupted copy): the archive's own reason, not metatrain's
    data = (demo_run / "best.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    assert main(["eval", str(tmp_path / "cut.ckpt"), str(demo_run / "dataset.xyz")]) == 2
    assert (
        "cut.ckpt' is not a readable petfunc or metatrain model file, damaged or truncated?"
        in capsys.readouterr().err
    )
    # a label key given on the command line but in no structure (a typo): an error, not
    # a table without its energy row
    assert (
        main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz"), "--energy-key", "E"]) == 2
    )
    assert "no structure has labels under the key(s) ['E'] (keys in the file:" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(demo_run / "dataset.xyz"),
                "--stress-key",
                "stress",
                "--virial-key",
                "virial",
            ]
        )
        == 2
    )
    assert "give --stress-key or --virial-key, not both" in capsys.readouterr().err
    # a negative batch size read no structure and exited 0 ("no labels in the file")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz"), "--batch-size", "-3"])
    assert exit_info.value.code == 2
    assert "argument --batch-size: expected a positive integer, got -3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        evaluate(demo_run / "best.ckpt", demo_run / "dataset.xyz", batch_size=0)


def test_train_errors(tmp_path, capsys):
    data = make_default_dataset(tmp_path / "d.xyz", n_structures=4)
    # unknown key in an options file
    bad = tmp_path / "bad.yaml"
    bad.write_text(
        yaml.safe_dump(
            {"training_set": str(data), "architecture": {"name": "pet", "training": {"learning_rat": 1e-3}}}
        )
    )
    assert main(["train", str(bad), "--output", str(tmp_path / "o1")]) == 2
    err = capsys.readouterr().err
    assert "unknown option 'architecture.training.learning_rat'" in err and "learning_rate" in err
    # missing dataset file
    missing = tmp_path / "missing.yaml"
    missing.write_text(yaml.safe_dump({"training_set": str(tmp_path / "nope.xyz")}))
    assert main(["train", str(missing), "--output", str(tmp_path / "o2")]) == 2
    assert "training_set: dataset file not found" in capsys.readouterr().err
    # missing options file, bad --set
    assert main(["train", str(tmp_path / "none.yaml")]) == 2
    assert "options file not found" in capsys.readouterr().err
    assert main(["train", "--output", str(tmp_path / "o3"), "--set", "architecture.model.d_pet=0"]) == 2
    assert "d_pet" in capsys.readouterr().err
    # runs that stop before training leave no output folder behind
    assert not any((tmp_path / name).exists() for name in ("o1", "o2", "o3"))
    assert main(["train", str(missing), "--output", str(data)]) == 2
    assert "the output folder" in capsys.readouterr().err and data.is_file()


def test_failed_start_leaves_the_folder_as_it_was(demo_run, tmp_path, capsys):
    """A run that stops before training removes what it wrote (options.yaml, the
    folders it made) and restores an options.yaml it replaced; a user's files stay."""
    import shutil

    data = make_default_dataset(tmp_path / "d.xyz", n_structures=4)
    options = tmp_path / "o.yaml"
    options.write_text(
        yaml.safe_dump({"training_set": str(data), "architecture": {"name": "pet", "model": {"cutoff": 0}}})
    )
    assert main(["train", str(options), "--output", str(tmp_path / "a" / "b" / "c")]) == 2
    assert "removed the output folder" in capsys.readouterr().err
    assert not (tmp_path / "a").exists()
    # an existing folder: the user's file stays, the folder stays, options.yaml goes
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("keep")
    assert main(["train", str(options), "--output", str(tmp_path / "mine")]) == 2
    assert sorted(p.name for p in (tmp_path / "mine").iterdir()) == ["notes.txt"]
    # a restart into its own folder with options the checkpoint rejects
    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    args = [
        "train",
        "--restart",
        str(run / "last.ckpt"),
        "--epochs",
        "2",
        "--set",
        "architecture.model.d_pet=16",
        "--no-progress",
    ]
    assert main(args) == 2
    assert "differs from the architecture of the restart checkpoint" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_labels_missing_from_some_structures_are_errors(tmp_path, capsys):
    """A label key that some structures of a training file lack would silently drop
    their term (metatrain's reader stops too): the error names the file, the label
    and the structures; NaN labels, the deliberate form, train."""
    import ase.io
    import numpy as np

    frames = ase.io.read(make_default_dataset(tmp_path / "d.xyz", n_structures=8), ":")
    for atoms in frames:  # labels as info/arrays, the other place extxyz keeps them
        atoms.info["energy"], atoms.arrays["forces"] = atoms.get_potential_energy(), atoms.get_forces()
        atoms.info["stress"], atoms.calc = atoms.get_stress(voigt=False), None
    del frames[2].info["energy"], frames[6].info["energy"]
    del frames[5].arrays["forces"]
    ase.io.write(tmp_path / "partial.xyz", frames)
    options = tmp_path / "o.yaml"
    options.write_text(
        yaml.safe_dump({"training_set": str(tmp_path / "partial.xyz"), "validation_set": 0.25})
    )
    assert main(["train", str(options), "--output", str(tmp_path / "o1"), "--epochs", "1", *TINY]) == 2
    err = capsys.readouterr().err
    assert (
        "partial.xyz': 2 of 8 structures have no energy label under the key 'energy' (structures 2, 6)" in err
    )
    # energies complete, forces missing from one structure: the whole file is checked, before the split
    frames[2].info["energy"] = frames[6].info["energy"] = 1.0
    ase.io.write(tmp_path / "partial.xyz", frames)
    assert main(["train", str(options), "--output", str(tmp_path / "o2"), "--epochs", "1", *TINY]) == 2
    assert (
        "1 of 8 structures has no forces label under the key 'forces' (structure 5)"
        in capsys.readouterr().err
    )
    frames[5].arrays["forces"] = np.full((len(frames[5]), 3), np.nan)
    ase.io.write(tmp_path / "partial.xyz", frames)
    assert main(["train", str(options), "--output", str(tmp_path / "o3"), "--epochs", "1", *TINY]) == 0


def test_ctrl_c_in_the_first_epoch_leaves_no_folder(tmp_path):
    """SIGINT once training has started but before its first checkpoint: exit status
    130 and no output folder left behind."""
    import os
    import signal
    import subprocess
    import sys

    out = tmp_path / "run"
    # stderr to a file: a full pipe that nobody reads would block the run
    with open(tmp_path / "stderr.txt", "w") as stderr:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "petfunc",
                "train",
                "--structures",
                "320",
                "--no-progress",
                "--threads",
                "1",
                "-o",
                str(out),
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
            env=dict(os.environ, PYTHONUNBUFFERED="1"),
            preexec_fn=lambda: signal.signal(
                signal.SIGINT, signal.SIG_DFL
            ),  # not ignored, as under a shell's '&'
        )
        try:
            for line in process.stdout:
                if line.startswith("per epoch:"):  # the last line before the first step
                    break
            assert (out / "options.yaml").is_file()
            process.send_signal(signal.SIGINT)
            process.communicate(timeout=120)
        finally:
            process.kill()
    err = (tmp_path / "stderr.txt").read_text()
    assert process.returncode == 130, err[-2000:]
    assert "removed the output folder" in err and err.rstrip().endswith("petfunc: interrupted")
    assert not out.exists()


def test_python_dash_m(tmp_path):
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "petfunc", "train", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0 and "--restart" in out.stdout


def test_entry_point_declared():
    scripts = {e.name: e.value for e in importlib.metadata.entry_points(group="console_scripts")}
    assert scripts.get("petfunc") == "petfunc.cli:main"
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0


def test_example_options_are_the_defaults():
    from pathlib import Path

    from petfunc.config import PETConfig
    from petfunc.trainer.options import TRAINING_DEFAULTS, resolve_options

    path = Path(__file__).resolve().parents[1] / "examples" / "options.yaml"
    options = resolve_options(yaml.safe_load(path.read_text()))
    model = options["architecture"]["model"]
    assert PETConfig.from_hypers({"atomic_types": [1], **model}) == PETConfig(atomic_types=(1,))
    assert options["architecture"]["training"] == TRAINING_DEFAULTS
    defaults = resolve_options({"training_set": "train.xyz"})
    options["architecture"]["model"] = defaults["architecture"]["model"] = {}
    assert options == defaults


def test_demo_options_on_own_data(demo_run, tmp_path):
    # No options file, but --set training_set=FILE: the demo's options on that file.
    out = tmp_path / "own"
    args = [
        "train",
        "--output",
        str(out),
        "--epochs",
        "1",
        "--set",
        f"training_set={demo_run / 'dataset.xyz'}",
        *TINY,
    ]
    assert main(args) == 0
    assert not (out / "dataset.xyz").exists() and (out / "best.ckpt").is_file()


def test_options_read_exponent_numbers_as_metatrain_does(tmp_path):
    """metatrain reads options with OmegaConf, where ``1e-3`` is a number; PyYAML's
    YAML 1.1 rules alone would give the string '1e-3' (a rejected learning rate, or a
    validation "file" named 1e-1)."""
    from petfunc.cli.commands import parser
    from petfunc.cli.options import overrides, read_options_file
    from petfunc.trainer.options import resolve_options

    path = tmp_path / "options.yaml"
    path.write_text(
        "training_set: train.xyz\nvalidation_set: 1e-1\n"
        "architecture:\n  training:\n    learning_rate: 1e-3\n    weight_decay: 5E-5\n"
        "  model:\n    cutoff: 45e-1\n    d_pet: 1e3x\n"
    )
    given = read_options_file(path)
    assert given["validation_set"] == 0.1 and given["architecture"]["model"]["d_pet"] == "1e3x"
    given["architecture"]["model"].pop("d_pet")
    options = resolve_options(given)
    training = options["architecture"]["training"]
    assert training["learning_rate"] == 1e-3 and training["weight_decay"] == 5e-5
    assert options["architecture"]["model"]["cutoff"] == 4.5
    args = parser().parse_args(
        ["train", "--set", "architecture.training.learning_rate=2e-3", "--set", "seed='7'"]
    )
    assert dict(overrides(args)) == {"architecture.training.learning_rate": 2e-3, "seed": "7"}


def test_training_checkpoint_in_python(demo_run):
    """``petfunc.load_model`` reads a training checkpoint; ``load_params`` (for
    parameter files) names it as one and says what to use instead."""
    import petfunc

    config, best = petfunc.load_model(demo_run / "best.ckpt")
    again, saved = petfunc.load_params(demo_run / "best_params.pt")
    assert config == again
    assert all(
        torch.equal(a, b)
        for a, b in zip(petfunc.tree.flatten(best).values(), petfunc.tree.flatten(saved).values())
    )
    with pytest.raises(
        ValueError,
        match=r"is a petfunc training checkpoint, not a parameter file: read it with "
        r"petfunc.load_model",
    ):
        petfunc.load_params(demo_run / "best.ckpt")
