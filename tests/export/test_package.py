"""Deployment artifacts (petfunc.export, ``petfunc export``).

The exported program must give the eager torch.func numbers (float64, to round-off:
it is the same aten graph) for structures of other sizes than the one it is traced
on, adaptive cutoff included; the calculator on top of it must equal the eager
calculator; bad files and inputs get clear errors. The AOTInductor build (minutes of
C++ compilation) is ``@pytest.mark.slow``.
"""

from pathlib import Path

import ase
import ase.build
import numpy as np
import pytest
import torch

import petfunc
import petfunc.export as pexport
from petfunc.ase import PETCalculator
from petfunc.cli.commands import main
from petfunc.structures import collate, prepare_atoms
from tests.helpers.exported import CONFIG, make_params, reference, structures


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """One ``petfunc export --no-aoti`` run (the slow part), shared by the tests."""
    params = make_params()
    folder = tmp_path_factory.mktemp("export")
    source = folder / "params.pt"
    petfunc.save_params(source, CONFIG, params)
    path = folder / "deploy" / "model.pt2"
    assert main(["export", str(source), str(path), "--dtype", "float64", "--no-aoti"]) == 0
    return params, path, pexport.load(path)


def test_exported_program_equals_eager(exported):
    params, path, model = exported
    assert not model.aoti and model.config == CONFIG and model.dtype == torch.float64
    for atoms in structures():
        inputs, expected = reference(params, atoms)
        got = model(*inputs)
        for name, a, b in zip(pexport.OUTPUTS, got, expected):
            assert a.shape == b.shape, name
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=name)
    # per-atom energies of the same pass sum to the energies
    energy, energies, *_ = got
    per_structure = torch.zeros_like(energy).index_add(0, inputs[2].structure_index, energies)
    torch.testing.assert_close(per_structure, energy, rtol=1e-12, atol=1e-9)


def test_exported_calculator_equals_eager_calculator(exported):
    params, path, model = exported
    exported_calc = PETCalculator(CONFIG, exported=model)
    eager_calc = PETCalculator(CONFIG, params)
    for atoms in structures():
        properties = ["energy", "energies", "forces"] + (["stress"] if atoms.pbc.all() else [])
        for calc in (exported_calc, eager_calc):
            calc.calculate(atoms.copy(), properties)
        for key in properties:
            np.testing.assert_allclose(
                exported_calc.results[key], eager_calc.results[key], rtol=1e-11, atol=1e-11, err_msg=key
            )


def test_export_errors(exported, tmp_path):
    params, path, model = exported
    with pytest.raises(ValueError, match=r"\.pt2"):
        pexport.export(CONFIG, params, tmp_path / "model.pt")
    garbage = tmp_path / "garbage.pt2"
    garbage.write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a PT2 archive"):
        pexport.load(garbage)
    with pytest.raises(FileNotFoundError):
        pexport.load(tmp_path / "missing.pt2")
    with pytest.raises(ValueError, match="no AOTInductor"):
        pexport.load(path, aoti=True)
    # a lone structure without the padding molecule has sizes below 2
    positions, cell, neighbors = collate(
        [prepare_atoms(ase.build.molecule("H2O"), CONFIG)], CONFIG, dtype=torch.float64
    )
    with pytest.raises(ValueError, match="at least 2"):
        model(positions, cell, neighbors)
    calc = PETCalculator(CONFIG, exported=model)
    with pytest.raises(ValueError, match="does not know"):
        calc.calculate(ase.build.molecule("NH3"), ["energy"])
    with pytest.raises(ValueError, match="own weights"):
        PETCalculator(CONFIG, params, exported=model)
    with pytest.raises(ValueError, match="computes in torch.float64, not torch.float32"):
        PETCalculator(CONFIG, exported=model, dtype=torch.float32)  # an error, not ignored
    # an export given to the loaders of other files: they name it and from_exported
    # (not torch's "corrupted checkpoint" error, nor metatrain)
    from petfunc.io import load_model

    for load in (petfunc.load_params, petfunc.from_metatrain, load_model, PETCalculator.from_checkpoint):
        with pytest.raises(ValueError, match=r"is a model written by petfunc export.*from_exported"):
            load(path)
    # a petfunc file given to from_metatrain; a folder given for a file
    with pytest.raises(ValueError, match=r"is a petfunc file \(petfunc.params\), not a metatrain checkpoint"):
        petfunc.from_metatrain(path.parent.parent / "params.pt")
    for load in (petfunc.load_params, petfunc.from_metatrain, load_model, pexport.load):
        with pytest.raises(FileNotFoundError, match="is a folder, not"):
            load(path.parent)


def test_cli_export(exported, tmp_path, capsys):
    params, path, model = exported
    assert [p.name for p in path.parent.iterdir()] == ["model.pt2"]  # no leftovers
    calc = PETCalculator.from_exported(path)
    assert not calc.exported.aoti and calc.dtype == torch.float64
    source = path.parent.parent / "params.pt"
    assert main(["export", str(source), str(tmp_path / "model.bin")]) == 2
    assert ".pt2" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing.pt"), str(tmp_path / "m.pt2")]) == 2
    assert not (tmp_path / "m.pt2").exists()
    assert main(["export", str(source), str(tmp_path / "m.pt2"), "--long-range", "ewald"]) == 2
    assert "has no long-range features" in capsys.readouterr().err
    assert not (tmp_path / "m.pt2").exists()


@pytest.mark.slow
def test_aoti_artifact_equals_eager(tmp_path):
    params = make_params()
    path = pexport.export(CONFIG, params, tmp_path / "model.pt2", dtype=torch.float64)
    model = pexport.load(path)
    assert model.aoti
    for atoms in structures():
        inputs, expected = reference(params, atoms)
        for name, a, b in zip(pexport.OUTPUTS, model(*inputs), expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=name)
    # the program stays loadable on its own
    assert not pexport.load(path, aoti=False).aoti


def test_aoti_build_is_the_default_on_the_cpu_only(monkeypatch, tmp_path):
    """export() and `petfunc export` build the AOTInductor library by default for the
    CPU and not for a GPU (where the build can crash the process that loads it);
    --aoti asks for it anyway. The CLI's choice is checked with the builder replaced
    by a recorder."""
    from petfunc.cli import commands as cli

    assert pexport.default_aoti("cpu") and pexport.default_aoti(torch.device("cpu"))
    assert not pexport.default_aoti("cuda") and not pexport.default_aoti("cuda:1")
    asked = []

    def recorder(
        config,
        params,
        path,
        dtype=torch.float32,
        device="cpu",
        aoti=None,
        inductor_configs=None,
        long_range=None,
    ):
        asked.append((str(device), aoti))
        path = Path(path)
        path.write_bytes(b"")
        return path

    monkeypatch.setattr("petfunc.cli.export.export", recorder)
    monkeypatch.setattr("petfunc.cli.export.load_model", lambda *args, **kwargs: (CONFIG, make_params()))
    # --device cuda passes the device check on any machine (nothing runs there)
    monkeypatch.setattr(torch.version, "cuda", torch.version.cuda or "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    for flags, expected in (
        ([], ("cpu", True)),
        (["--device", "cuda"], ("cuda", False)),
        (["--device", "cuda", "--aoti"], ("cuda", True)),
        (["--no-aoti"], ("cpu", False)),
    ):
        assert cli.main(["export", "model.ckpt", str(tmp_path / "m.pt2"), *flags]) == 0
        assert asked[-1] == expected, flags
    with pytest.raises(SystemExit):
        cli.main(["export", "model.ckpt", str(tmp_path / "m.pt2"), "--aoti", "--no-aoti"])
