"""Malicious files through every loader and command: a file that would run code when
loaded is refused, and the code never runs (its marker file never appears)."""

from __future__ import annotations

import contextlib
import io

import ase.build
import pytest
import torch
import yaml

import petfunc
from petfunc.ase import PETCalculator
from petfunc.cli import main
from petfunc.export import export
from petfunc.export import load as export_load
from petfunc.io import read_metatrain_baseline
from petfunc.io.formats import is_torchscript
from petfunc.trainer import fit
from tests.helpers.cli import TINY
from tests.helpers.hostile import code_running_pickle, compiler, disguised_pickle, library_in_archive
from tests.helpers.trainer import quiet, tiny_options


pytest.importorskip("metatrain")

TINY_PET = dict(d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2, num_gnn_layers=1)


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


@pytest.fixture(scope="module")
def foreign_library(tmp_path_factory):
    """``(artifact, marker, clean)``: a tiny model's exported program, and a copy of it
    with a library that creates ``marker`` when loaded, as if exported elsewhere."""
    if compiler() is None:
        pytest.skip("no C compiler to build the library")
    folder = tmp_path_factory.mktemp("foreign")
    config = petfunc.PETConfig(atomic_types=(1, 6), **TINY_PET)
    params = petfunc.init(config, seed=0, dtype=torch.float64)
    clean = export(config, params, folder / "clean.pt2", dtype=torch.float64, aoti=False)
    marker = folder / "library_loaded"
    return library_in_archive(clean, folder / "foreign.pt2", marker), marker, clean


def test_a_foreign_library_is_not_loaded_unless_asked(foreign_library):
    path, marker, clean = foreign_library
    for load in (export_load, PETCalculator.from_exported):
        with pytest.warns(UserWarning, match="native code that runs when it is loaded"):
            loaded = load(path)
        assert not marker.exists()
    assert not loaded.exported.aoti
    # the program runs, and gives what the clean file gives
    atoms = ase.build.molecule("CH4")
    atoms.calc = loaded
    expected = atoms.copy()
    expected.calc = PETCalculator.from_exported(clean)
    assert atoms.get_potential_energy() == pytest.approx(expected.get_potential_energy(), rel=1e-12)
    # asked for, the library is loaded: the file is live, so the checks above can fail
    with pytest.raises(Exception):  # noqa: B017 - it is no real AOTInductor library
        export_load(path, aoti=True)
    assert marker.exists()


def _every_loader(tmp_path, dataset):
    """``{name: load(path)}``: every function and command that reads a model file."""

    def finetune(path):
        training = {"finetune": {"read_from": str(path), "method": "full"}}
        return fit(
            tiny_options(dataset, num_epochs=1, **training), tmp_path / "ft", progress=False, log=quiet()
        )

    def command(*words):
        def run(path):
            with contextlib.redirect_stderr(io.StringIO()) as err:
                code = main([word.replace("PATH", str(path)) for word in words])
            if code != 0:
                raise ValueError(f"exit status {code}: {err.getvalue()}")

        return run

    return {
        "load_model": petfunc.load_model,
        "load_params": petfunc.load_params,
        "read_checkpoint": petfunc.io.read_checkpoint,
        "from_metatrain": petfunc.from_metatrain,
        "PETCalculator.from_checkpoint": PETCalculator.from_checkpoint,
        "PETCalculator.from_metatrain": PETCalculator.from_metatrain,
        "fine-tuning": finetune,
        "petfunc eval": command("eval", "PATH", str(dataset)),
        "petfunc export": command("export", "PATH", str(tmp_path / "out.pt2"), "--no-aoti"),
        "petfunc train --restart": command(
            "train", "--restart", "PATH", "--output", str(tmp_path / "r"), *TINY
        ),
    }


@pytest.mark.parametrize("gzipped", [False, True], ids=["zip", "gzip"])
def test_a_pickle_that_runs_code_through_every_loader_and_command(dataset, tmp_path, gzipped):
    """A plain torch.save archive with a code-running object: every loader refuses it,
    none runs it."""
    marker = tmp_path / "code_ran"
    path = code_running_pickle(tmp_path / "model.ckpt", marker, gzipped)
    for name, load in _every_loader(tmp_path, dataset).items():
        with pytest.raises(ValueError, match="could run code|gzip-compressed") as refused:
            load(path)
        assert str(path) in str(refused.value), name
        assert not marker.exists(), name
