"""Malicious files through every loader and command: a file that would run code when
loaded is refused, and the code never runs (its marker file never appears)."""

from __future__ import annotations

import pytest
import torch
import yaml

import petfunc
from petfunc.ase import PETCalculator
from petfunc.cli import main
from petfunc.io import read_metatrain_baseline
from petfunc.io.formats import is_torchscript
from petfunc.trainer import fit
from tests.helpers.cli import TINY
from tests.helpers.hostile import disguised_pickle
from tests.helpers.trainer import quiet, tiny_options


pytest.importorskip("metatrain")


@pytest.fixture
def exploit(tmp_path):
    """``(file, marker)``: a pickle disguised as a TorchScript export."""
    marker = tmp_path / "code_ran"
    return disguised_pickle(tmp_path / "composition.ckpt", marker), marker


def test_the_disguised_pickle_runs_code_when_fully_unpickled(exploit):
    """The exploit is live: a full unpickling runs it (so the tests below can fail)."""
    path, marker = exploit
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_the_disguised_pickle_is_not_taken_for_torchscript(exploit):
    path, _ = exploit
    assert not is_torchscript(path)
    assert not is_torchscript(path.read_bytes())


@pytest.mark.parametrize("kind", ["composition", "scaler"])
def test_a_baseline_file_runs_no_code(exploit, kind):
    path, marker = exploit
    with pytest.raises(ValueError, match="does not unpickle .*posix.system|does not unpickle .*os.system"):
        read_metatrain_baseline(path, kind, [1, 6], "eV")
    assert not marker.exists()


def test_training_with_the_file_as_a_baseline_runs_no_code(dataset, exploit):
    """(A scaler file, read by the same function, needs a real composition checkpoint
    beside it: test_a_baseline_file_runs_no_code covers it.)"""
    path, marker = exploit
    with pytest.raises(ValueError, match="does not unpickle"):
        fit(tiny_options(dataset, num_epochs=0, atomic_baseline=str(path)), None, progress=False, log=quiet())
    assert not marker.exists()


def test_petfunc_train_with_the_file_as_a_baseline_runs_no_code(dataset, exploit, tmp_path, capsys):
    path, marker = exploit
    options = tmp_path / "options.yaml"
    options.write_text(
        yaml.safe_dump(
            {"training_set": str(dataset), "architecture": {"training": {"atomic_baseline": str(path)}}}
        )
    )
    code = main(["train", str(options), "--output", str(tmp_path / "run"), "--epochs", "1", *TINY])
    assert code != 0
    assert "does not unpickle" in capsys.readouterr().err
    assert not marker.exists()


@pytest.mark.parametrize(
    "load",
    [
        lambda path: petfunc.load_model(path),
        lambda path: petfunc.from_metatrain(path),
        lambda path: PETCalculator.from_checkpoint(path),
        lambda path: PETCalculator.from_metatrain(path),
    ],
    ids=["load_model", "from_metatrain", "PETCalculator.from_checkpoint", "PETCalculator.from_metatrain"],
)
def test_model_loaders_run_no_code(exploit, load):
    path, marker = exploit
    with pytest.raises(ValueError):
        load(path)
    assert not marker.exists()


def test_petfunc_eval_runs_no_code(dataset, exploit, capsys):
    path, marker = exploit
    assert main(["eval", str(path), str(dataset)]) != 0
    assert not marker.exists()
