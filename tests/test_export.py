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
from test_long_range import _params as perturbed_params  # random weights with non-trivial charges

import petfunc
import petfunc.export as pexport
from petfunc.ase import PETCalculator
from petfunc.cli.commands import main
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
    inputs = collate(
        [prepare_atoms(atoms, CONFIG), padding_sample(CONFIG).structure], CONFIG, dtype=torch.float64
    )
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
        PETCalculator(CONFIG, exported=model, dtype=torch.float32)  # it was ignored
    # an export given to the loaders of other files: they named torch's "corrupted
    # checkpoint" error or metatrain, not from_exported
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


def test_check_dynamic_finds_bounds():
    """Export can keep a size symbolic and still bound it: the artifact would then
    refuse batches that the model takes."""

    class Cat(torch.nn.Module):
        def forward(self, a, b):
            return torch.cat([a, b])

    class Branch(torch.nn.Module):
        def forward(self, a, b):
            return a * 2 if a.shape[0] > 5 else a, b

    auto = torch.export.Dim.AUTO
    names = ("species", "centers")
    dynamic = ({0: auto}, {0: auto})
    a, b = torch.ones(8), torch.ones(7)
    pexport.check_dynamic(torch.export.export(Cat(), (a, b), dynamic_shapes=dynamic), names)
    with pytest.raises(RuntimeError, match=r"bounded the size s\d+ to \[6, "):
        pexport.check_dynamic(torch.export.export(Branch(), (a, b), dynamic_shapes=dynamic), names)
    with pytest.raises(RuntimeError, match="specialised size 0 of 'centers' to 7"):
        pexport.check_dynamic(torch.export.export(Cat(), (a, b), dynamic_shapes=({0: auto}, None)), names)


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


def test_export_for_another_device_is_traced_on_the_cpu(monkeypatch):
    """For a GPU the export is traced on the CPU and moved (petfunc.compile's
    _trace_device and _move_graph). Checked with the meta device standing in for the
    GPU: every constant of the program (the weights included) and every output must
    be on it, or the run fails."""
    import importlib

    compile_module = importlib.import_module("petfunc.compile.compiled")
    own = compile_module._trace_device
    monkeypatch.setattr(
        compile_module,
        "_trace_device",
        lambda tensors: torch.device("cpu") if tensors[0].device.type == "meta" else own(tensors),
    )
    program, example = pexport.trace(CONFIG, make_params(), torch.float64, "meta")
    assert {t.device.type for t in example} == {"meta"}
    constants = [
        v
        for v in list(program.constants.values()) + list(program.state_dict.values())
        if isinstance(v, torch.Tensor)
    ]
    assert constants and all(v.device.type == "meta" for v in constants)
    out = program.module()(*example)
    assert len(out) == len(pexport.OUTPUTS) and all(t.device.type == "meta" for t in out)


def test_aoti_build_is_the_default_on_the_cpu_only(monkeypatch, tmp_path):
    """export() and `petfunc export` build the AOTInductor library by default for the
    CPU and not for a GPU (where its one build tried crashed the loading process);
    --aoti asks for it anyway. The CLI's choice is checked with the builder replaced
    by a recorder."""
    from petfunc.cli import commands as cli
    from petfunc.cli import export as cli_export

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

    monkeypatch.setattr(cli_export, "export", recorder)
    monkeypatch.setattr(cli_export, "load_model", lambda *args, **kwargs: (CONFIG, make_params()))
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


# ---------------------------------------------------------------------------------------
# long-range models

LR_CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 8), long_range=dict(enable=True), **SMALL)


def lr_params():
    return perturbed_params(LR_CONFIG, seed=5)


def lr_structures():
    """Crystals whose P3M meshes differ from the traced one (8 x 16 x 16), down to
    4 points along c, and molecules."""
    diamond = ase.build.bulk("C", "diamond", a=3.57, cubic=True)  # mesh 8 x 8 x 8
    diamond.symbols[[2, 5]] = "O"
    diamond.rattle(0.08, seed=1)
    longer = ase.build.bulk("C", "diamond", a=3.6, cubic=True).repeat((3, 1, 1))  # 32 x 8 x 8
    longer.rattle(0.1, seed=2)
    # a chain along a short c vector (1.9 Å: 4 mesh points), triclinic
    chain = ase.Atoms(
        "CO",
        positions=[[0.1, 0.2, 0.0], [0.3, -0.1, 0.95]],
        cell=[[5.0, 0.3, 0.0], [0.4, 5.5, 0.2], [0.1, 0.0, 1.9]],
        pbc=True,
    )
    methanol = ase.build.molecule("CH3OH")
    methanol.rattle(0.03, seed=3)
    water = ase.build.molecule("H2O")
    return {"crystals": [diamond, longer, chain], "molecules": [methanol, water]}


@pytest.fixture(scope="module", params=["p3m", "ewald"])
def lr_exported(request, tmp_path_factory):
    params = lr_params()
    path = tmp_path_factory.mktemp("lr") / "model.pt2"
    pexport.export(LR_CONFIG, params, path, dtype=torch.float64, aoti=False, long_range=request.param)
    return request.param, params, pexport.load(path), path


def lr_batches(method):
    """Batches the artifact of ``method`` takes: P3M one crystal (first) at most."""
    found = lr_structures()
    crystals, molecules = found["crystals"], found["molecules"]
    batches = [[c] for c in crystals] + [[c] + molecules for c in crystals[:1]]
    batches += [molecules[:1], molecules]
    if method == "ewald":
        batches += [crystals, molecules + crystals[:2]]
    return batches


def lr_reference(params, frames, method):
    structures = [prepare_atoms(a, LR_CONFIG) for a in frames] + [padding_sample(LR_CONFIG).structure]
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(LR_CONFIG).energy_terms)
    return structures, fn(params, *collate(structures, LR_CONFIG, dtype=torch.float64, long_range=method))


def test_long_range_export_equals_eager(lr_exported):
    """The exported program of a long-range model equals eager torch.func with the
    same reciprocal-space method, on meshes and k-grids of other sizes than the
    traced ones, whichever method the given inputs were built for."""
    method, params, model, _ = lr_exported
    assert model.long_range == method and model.metadata["version"] == 3
    assert model.metadata["inputs"][-1] == "lr_pair_mask" and model.metadata["long_range"] == method
    for frames in lr_batches(method):
        structures, expected = lr_reference(params, frames, method)
        for built_for in ("p3m", "ewald"):
            got = model(*collate(structures, LR_CONFIG, dtype=torch.float64, long_range=built_for))
            for name, a, b in zip(pexport.OUTPUTS, got, expected):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12, msg=f"{name} {built_for} {frames}")
    # the long-range part is not negligible in these outputs
    frames = lr_batches(method)[0]
    structures, expected = lr_reference(params, frames, method)
    plain = petfunc.PETConfig(atomic_types=LR_CONFIG.atomic_types, **SMALL)
    short = {k: v for k, v in params.items() if k != "long_range_featurizer"}
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(plain).energy_terms)
    without = fn(short, *collate(structures, plain, dtype=torch.float64))
    assert (expected[2] - without[2]).abs().max() > 1e-3


def test_long_range_export_errors_and_calculator(lr_exported):
    method, params, model, path = lr_exported
    crystals = lr_structures()["crystals"]
    structures = [prepare_atoms(a, LR_CONFIG) for a in crystals[:2]] + [padding_sample(LR_CONFIG).structure]
    if method == "p3m":
        with pytest.raises(ValueError, match=r"only the first structure of a call may be periodic.*\[0, 1\]"):
            model(*collate(structures, LR_CONFIG, dtype=torch.float64))
        # the calculator on the artifact equals the eager (P3M) calculator
        exported_calc = PETCalculator(LR_CONFIG, exported=model)
        eager_calc = PETCalculator(LR_CONFIG, params)
        for atoms in crystals + lr_structures()["molecules"]:
            properties = ["energy", "forces"] + (["stress"] if atoms.pbc.all() else [])
            for calc in (exported_calc, eager_calc):
                calc.calculate(atoms.copy(), properties)
            for key in properties:
                np.testing.assert_allclose(
                    exported_calc.results[key], eager_calc.results[key], rtol=1e-11, atol=1e-11, err_msg=key
                )
    else:
        # the calculator on an Ewald artifact builds Ewald inputs
        calc = PETCalculator.from_exported(path)
        for atoms in crystals:
            calc.calculate(atoms.copy(), ["energy", "forces"])
            _, (energy, _, forces, _) = lr_reference(params, [atoms], "ewald")
            np.testing.assert_allclose(calc.results["energy"], float(energy[0]), rtol=1e-11)
            np.testing.assert_allclose(
                calc.results["forces"], forces[: len(atoms)].numpy(), rtol=1e-10, atol=1e-11
            )
    positions, cell, neighbors = collate(structures, LR_CONFIG, dtype=torch.float64)
    with pytest.raises(ValueError, match="carry no long-range inputs"):
        model(positions, cell, neighbors._replace(long_range=None))
    with pytest.raises(ValueError, match="long_range must be one of"):
        pexport.export(LR_CONFIG, params, "unused.pt2", long_range="pme")


@pytest.mark.slow
def test_long_range_aoti_artifact_equals_eager(tmp_path):
    """AOTInductor builds the P3M model too (its FFTs run as ATen kernels). On torch <
    2.13, whose AOTInductor miscompiles the P3M strain derivative (measured on 2.11:
    wrong by about 100 % for a crystal, also after the fixes that made petfunc.compile
    right there), the build is refused and not the default."""
    from petfunc.model.long_range import P3M_AOTI_CORRECT

    params = lr_params()
    if not P3M_AOTI_CORRECT:
        assert not pexport.default_aoti("cpu", LR_CONFIG) and pexport.default_aoti("cpu", LR_CONFIG, "ewald")
        with pytest.raises(ValueError, match="miscompiles"):
            pexport.export(LR_CONFIG, params, tmp_path / "model.pt2", aoti=True)
        return
    model = pexport.load(pexport.export(LR_CONFIG, params, tmp_path / "model.pt2", dtype=torch.float64))
    assert model.aoti and model.long_range == "p3m"
    for frames in lr_batches("p3m"):
        structures, expected = lr_reference(params, frames, "p3m")
        got = model(*collate(structures, LR_CONFIG, dtype=torch.float64))
        for name, a, b in zip(pexport.OUTPUTS, got, expected):
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10, msg=f"{name} {frames}")
