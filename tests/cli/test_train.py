"""``petfunc train``: the demo end to end, restarts, errors, a folder left as it was
found after a failed start, Ctrl-C or SIGTERM.
"""

import csv
import sys

import pytest
import torch
import yaml

from petfunc.cli import main, make_default_dataset
from tests.helpers.cli import TINY


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


def tiny_overrides(flag):
    """The tiny model of ``TINY`` with metatrain's override flag ``flag``."""
    return [flag if item == "--set" else item for item in TINY]


def test_metatrain_command_line(tmp_path, monkeypatch, capsys):
    """``mtt train``'s spellings: ``-r/--override KEY=VALUE``, ``-o model.pt2`` (the
    exported model; the run folder under outputs/DATE/TIME), ``--restart auto``
    (the newest outputs/DATE/TIME/last.ckpt)."""
    import petfunc.export

    monkeypatch.chdir(tmp_path)
    args = [
        "train",
        "--structures",
        "8",
        *tiny_overrides("-r"),
        "--override",
        "architecture.training.num_epochs=1",
    ]
    assert main([*args, "-o", "model.pt2"]) == 0, capsys.readouterr().err
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert yaml.safe_load(open(run / "options.yaml"))["architecture"]["training"]["num_epochs"] == 1
    assert yaml.safe_load(open(run / "options.yaml"))["device"] == "cpu"  # auto, on this machine
    out = capsys.readouterr().out
    assert "device auto: cpu" in out or not torch.cuda.is_available()
    assert f"exported model: {tmp_path / 'model.pt2'}" in out
    assert (run / "model.pt2").read_bytes() == (tmp_path / "model.pt2").read_bytes()
    exported = petfunc.export.load(tmp_path / "model.pt2")
    assert exported.metadata["dtype"] == "float32"
    # --restart auto continues the newest run, in its folder
    assert main(["train", "--restart", "auto", "--epochs", "2", "--no-progress"]) == 0
    assert f"--restart auto: continuing {run.relative_to(tmp_path) / 'last.ckpt'}" in capsys.readouterr().out
    assert [r["epoch"] for r in csv.DictReader(open(run / "metrics.csv"))] == ["1", "2"]


def test_metatrain_command_line_errors(tmp_path, monkeypatch, capsys):
    """What -o and --restart auto cannot mean is said before anything is written."""
    monkeypatch.chdir(tmp_path)
    assert main(["train", "--restart", "auto"]) == 2
    err = capsys.readouterr().err
    assert "--restart auto: no checkpoint to continue: no DATE/TIME/last.ckpt in" in err
    (tmp_path / "run.pt2").mkdir()
    assert main(["train", "-o", "run.pt2", *TINY]) == 2
    assert "'run.pt2' is an existing folder" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "metatomic.torch", None)  # as if the extra were not installed
    assert main(["train", "-o", "model.pt", *TINY]) == 2
    assert "writing metatomic models needs the metatrain extra" in capsys.readouterr().err
    monkeypatch.delitem(sys.modules, "metatomic.torch")
    assert main(["train", "-o", "model.ckpt", *TINY]) == 2
    assert "the checkpoints are written into the run folder" in capsys.readouterr().err
    assert main(["train", "-r", "architecture.training.num_epochs", *TINY]) == 2
    assert "--set/--override expects KEY=VALUE" in capsys.readouterr().err
    assert main(["train", "--device", "multi-gpu", *TINY]) == 2
    assert "--device multi-gpu: petfunc trains on one device per process" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.pt2"]


def test_training_writes_a_metatomic_model(tmp_path, monkeypatch, capsys):
    """``petfunc train -o model.pt``: the best model as a metatomic model, as ``mtt train``."""
    metatomic = pytest.importorskip("metatomic.torch")
    monkeypatch.chdir(tmp_path)
    args = ["train", "--structures", "8", "--epochs", "1", *tiny_overrides("-r"), "-o", "model.pt"]
    assert main(args) == 0, capsys.readouterr().err
    model = metatomic.load_atomistic_model(str(tmp_path / "model.pt"))
    assert "energy" in model.capabilities().outputs
    (run,) = (tmp_path / "outputs").glob("*/*")
    assert (run / "model.pt").read_bytes() == (tmp_path / "model.pt").read_bytes()


def test_the_demo_writes_a_train_log(demo_run):
    text = (demo_run / "train.log").read_text(encoding="utf-8")
    assert f"petfunc training run in {demo_run}" in text and "command: " in text
    assert "versions: petfunc " in text and "device: cpu; dtype float32" in text
    assert "[INFO] - epoch    1/1 |" in text and "units: " in text


def test_train_log_of_a_restart_has_the_console_lines(demo_run, tmp_path, capsys):
    """A restart into the run's own folder appends to its train.log every line the
    console shows, after a line that names the restart."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    before = (run / "train.log").read_text(encoding="utf-8")
    capsys.readouterr()
    assert main(["train", "--restart", str(run / "last.ckpt"), "--epochs", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out.splitlines()
    text = (run / "train.log").read_text(encoding="utf-8")
    assert text.startswith(before) and f"restart from {run / 'last.ckpt'}" in text[len(before) :]
    assert any(line.startswith("epoch    2/2 |") for line in out)
    for line in out:
        if not line.startswith("output folder:"):  # said before the run, the header names it
            assert f"[INFO] - {line}\n" in text[len(before) :], line


@pytest.mark.parametrize("kind", ["cuda", "cpu"])
def test_out_of_memory_is_one_line(demo_run, tmp_path, capsys, monkeypatch, kind):
    """Out of memory in a step: one line on stderr naming the step and what to change,
    no traceback, exit status 1; the run's checkpoints intact."""
    import shutil

    from tests.helpers.runlog import ALLOCATOR_ERRORS, raise_in_step

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    before = (run / "last.ckpt").read_bytes()
    raise_in_step(monkeypatch, ALLOCATOR_ERRORS[kind])
    capsys.readouterr()
    assert main(["train", "--restart", str(run / "last.ckpt"), "--epochs", "2", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith("petfunc: out of memory on the CPU in the training step of epoch 2, batch 1 of ")
    assert "lower architecture.training.batch_size (now 4; --batch-size)" in err and "remat: true" in err
    assert (run / "last.ckpt").read_bytes() == before
    assert "[ERROR] - the run stopped: OutOfMemory: out of memory" in (run / "train.log").read_text()


def test_ctrl_c_in_the_first_epoch_puts_train_log_back(demo_run, tmp_path, capsys, monkeypatch):
    """A restart into its own folder stopped before its first checkpoint leaves the
    folder as it was: the lines it appended to train.log go."""
    import shutil

    from tests.helpers.runlog import raise_in_step

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    raise_in_step(monkeypatch, KeyboardInterrupt)
    assert main(["train", "--restart", str(run / "last.ckpt"), "--epochs", "2", "--no-progress"]) == 130
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before


def test_a_refused_run_leaves_the_holders_train_log_alone(demo_run, tmp_path, capsys):
    import os
    import shutil

    from tests.helpers.runlog import hold_folder

    run = tmp_path / "run"
    shutil.copytree(demo_run, run)
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    fd = hold_folder(run)
    try:
        assert main(["train", "--restart", str(run / "last.ckpt"), "--epochs", "2", "--no-progress"]) == 2
    finally:
        os.close(fd)
    assert "is in use by petfunc train (pid 4242" in capsys.readouterr().err
    assert (run / "train.log").read_bytes() == before["train.log"]
