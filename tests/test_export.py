"""Deployment artifacts (petfunc.export, ``petfunc export``).

The exported program must give the eager torch.func numbers (float64, to round-off:
it is the same aten graph) for structures of other sizes than the one it was traced
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
from petfunc import export as pexport
from petfunc.ase import PETCalculator
from petfunc.cli import main
from petfunc.data import padding_sample
from petfunc.structures import collate, prepare_atoms


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)
# adaptive cutoff on: its radii depend on positions, so forces and stress need their terms
CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 8), num_neighbors_adaptive=12, **SMALL)


def make_params(seed=3):
    params = petfunc.init(CONFIG, seed=seed, dtype=torch.float64)
    params["composition_weights"] = torch.tensor([-13.6, -1029.8, -2042.6], dtype=torch.float64)
    params["energy_scale"] = torch.tensor(1.7, dtype=torch.float64)
    return params


def structures():
    diamond = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    diamond.symbols[[2, 5]] = "O"
    diamond.rattle(0.08, seed=1)
    larger = ase.build.bulk("C", "diamond", a=3.6, cubic=True).repeat((2, 1, 1))
    larger.rattle(0.1, seed=2)
    methanol = ase.build.molecule("CH3OH")
    methanol.rattle(0.03, seed=3)
    return [diamond, larger, methanol]


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


def reference(params, atoms):
    inputs = collate([prepare_atoms(atoms, CONFIG), padding_sample(CONFIG).structure], CONFIG, dtype=torch.float64)
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(CONFIG).energy_terms)
    return inputs, fn(params, *inputs)


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
            np.testing.assert_allclose(exported_calc.results[key], eager_calc.results[key], rtol=1e-11, atol=1e-11, err_msg=key)


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
    positions, cell, neighbors = collate([prepare_atoms(ase.build.molecule("H2O"), CONFIG)], CONFIG, dtype=torch.float64)
    with pytest.raises(ValueError, match="at least 2"):
        model(positions, cell, neighbors)
    calc = PETCalculator(CONFIG, exported=model)
    with pytest.raises(ValueError, match="does not know"):
        calc.calculate(ase.build.molecule("NH3"), ["energy"])
    with pytest.raises(ValueError, match="own weights"):
        PETCalculator(CONFIG, params, exported=model)


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


def test_export_for_another_device_is_traced_on_the_cpu(monkeypatch):
    """For a GPU the export is traced on the CPU and moved (petfunc.compile's
    _trace_device and _move_graph). Checked with the meta device standing in for the
    GPU: every constant of the program (the weights included) and every output must
    be on it, or the run fails."""
    import importlib

    compile_module = importlib.import_module("petfunc.compile")
    own = compile_module._trace_device
    monkeypatch.setattr(compile_module, "_trace_device",
                        lambda tensors: torch.device("cpu") if tensors[0].device.type == "meta" else own(tensors))
    program, example = pexport.trace(CONFIG, make_params(), torch.float64, "meta")
    assert {t.device.type for t in example} == {"meta"}
    constants = [v for v in list(program.constants.values()) + list(program.state_dict.values())
                 if isinstance(v, torch.Tensor)]
    assert constants and all(v.device.type == "meta" for v in constants)
    out = program.module()(*example)
    assert len(out) == len(pexport.OUTPUTS) and all(t.device.type == "meta" for t in out)


def test_aoti_build_is_the_default_on_the_cpu_only(monkeypatch, tmp_path):
    """export() and `petfunc export` build the AOTInductor library by default for the
    CPU and not for a GPU (where its one build tried crashed the loading process);
    --aoti asks for it anyway. The CLI's choice is checked with the builder replaced
    by a recorder."""
    from petfunc import cli

    assert pexport.default_aoti("cpu") and pexport.default_aoti(torch.device("cpu"))
    assert not pexport.default_aoti("cuda") and not pexport.default_aoti("cuda:1")
    asked = []

    def recorder(config, params, path, dtype=torch.float32, device="cpu", aoti=None, inductor_configs=None):
        asked.append((str(device), aoti))
        path = Path(path)
        path.write_bytes(b"")
        return path

    monkeypatch.setattr(pexport, "export", recorder)
    monkeypatch.setattr("petfunc.trainer.load_model", lambda *args, **kwargs: (CONFIG, make_params()))
    for flags, expected in (([], ("cpu", True)), (["--device", "cuda"], ("cuda", False)),
                            (["--device", "cuda", "--aoti"], ("cuda", True)), (["--no-aoti"], ("cpu", False))):
        assert cli.main(["export", "model.ckpt", str(tmp_path / "m.pt2"), *flags]) == 0
        assert asked[-1] == expected, flags
    with pytest.raises(SystemExit):
        cli.main(["export", "model.ckpt", str(tmp_path / "m.pt2"), "--aoti", "--no-aoti"])
