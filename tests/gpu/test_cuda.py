"""PET on a CUDA device: the same numbers as on the CPU, metatrain's gradients, and
the compiled training step equal to eager with one graph for every batch shape.

Skipped where torch sees no CUDA device (CI has none); ``benchmarks/cuda_check.sh``
runs them on a GPU machine. ``PETFUNC_TEST_DEVICE=cpu`` runs them on the CPU
instead, to check the tests themselves on a machine without a GPU.
"""

import os

import ase.build
import numpy as np
import pytest
import torch

import petfunc
import petfunc.ensemble as ensemble
from tests.helpers import training
from tests.helpers.training import relative


DEVICE = torch.device(os.environ.get("PETFUNC_TEST_DEVICE", "cuda"))
F64 = torch.float64
pytestmark = pytest.mark.skipif(
    DEVICE.type == "cuda" and not torch.cuda.is_available(), reason="torch sees no CUDA device"
)

# metatrain's default PET widths with an adaptive cutoff: every position-dependent
# term of the energy (switching functions, adaptive radii) on the device
ADAPTIVE = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), cutoff=5.0, num_neighbors_adaptive=8.0)


def _molecules():
    frames = []
    for k, name in enumerate(["CH3CH2OH", "C6H6", "CH3COOH", "H2O"]):
        atoms = ase.build.molecule(name)
        atoms.rattle(0.05, seed=k)
        frames.append(atoms)
    # a periodic structure too, for the stress
    bulk = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    bulk.rattle(0.05, seed=7)
    frames.append(bulk)
    return frames


def test_energy_forces_stress_equal_cpu():
    """Default-width PET with an adaptive cutoff, float64: the device's energies,
    forces and stress equal the CPU's to round-off."""
    model = petfunc.PET(ADAPTIVE)
    frames = _molecules()
    efs = petfunc.energy_forces_stress(model.energy)
    results = {}
    for device in ("cpu", DEVICE):
        params = model.init(seed=1, dtype=F64, device=device)
        positions, cell, neighbors = petfunc.from_atoms(frames, ADAPTIVE, dtype=F64, device=device)
        assert positions.device.type == torch.device(device).type
        results[str(device)] = efs(params, positions, cell, neighbors)
    cpu, dev = results["cpu"], results[str(DEVICE)]
    for name, a, b in zip(("energy", "forces", "stress"), dev, cpu):
        finite = torch.isfinite(b)
        assert torch.equal(torch.isfinite(a).cpu(), finite), name
        assert relative(a[finite.to(a.device)], b[finite]) < 1e-10, name
    # the autograd path (the trainer's and the calculator's eager one) agrees too
    positions, cell, neighbors = petfunc.from_atoms(frames, ADAPTIVE, dtype=F64, device=DEVICE)
    params = model.init(seed=1, dtype=F64, device=DEVICE)
    autograd = petfunc.energy_forces_stress(model.energy, autodiff="autograd")(
        params, positions, cell, neighbors
    )
    assert relative(autograd[1], dev[1]) < 1e-10


def test_forces_are_finite_differences_of_the_energy():
    """Forces on the device are -dE/dx, adaptive cutoff included (central differences)."""
    model = petfunc.PET(ADAPTIVE)
    frames = _molecules()[:2]
    params = model.init(seed=2, dtype=F64, device=DEVICE)
    positions, cell, neighbors = petfunc.from_atoms(frames, ADAPTIVE, dtype=F64, device=DEVICE)
    forces = petfunc.forces(model.energy)(params, positions, cell, neighbors)
    h = 1e-5
    for atom, axis in [(0, 0), (3, 1), (positions.shape[0] - 1, 2)]:
        shifted = []
        for sign in (1, -1):
            p = positions.clone()
            p[atom, axis] += sign * h
            shifted.append(model.energy(params, p, cell, neighbors).sum())
        numeric = -(shifted[0] - shifted[1]) / (2 * h)
        assert abs(forces[atom, axis].item() - numeric.item()) < 1e-6 * max(1.0, abs(numeric.item())), (
            atom,
            axis,
        )


def test_parameter_gradients_match_metatrain_on_device(dataset, fitted):
    """petfunc's torch.func parameter gradients of the training loss (energy, forces,
    stress) on the device equal metatrain's training-mode gradients on the device."""
    training.check_gradients_against_metatrain(dataset, fitted, DEVICE)


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_step_equals_eager_on_every_shape(dataset, fitted, backend):
    """The whole training step compiled on the device: every metric, parameter update
    and optimizer moment equals eager's (float64, 1e-9) on five batch shapes (one of a
    single structure), one graph; then donated, step after step, as `petfunc train`
    runs it."""
    step, compiled, state = training.warmed_up_compiled_step(dataset, fitted, DEVICE, backend=backend)
    training.check_compiled_train_step(step, compiled, state, dataset, fitted, DEVICE)
    # donated: the compiled step trains its own state in place, following eager
    training.check_donated_step(step, state, dataset, fitted, backend, DEVICE)


def test_ensemble_equals_members():
    """A vmap'd committee of three on the device equals its members one by one."""
    model = petfunc.PET(ADAPTIVE)
    frames = _molecules()
    positions, cell, neighbors = petfunc.from_atoms(frames, ADAPTIVE, dtype=F64, device=DEVICE)
    stacked = ensemble.init(model, [0, 1, 2], dtype=F64, device=DEVICE)
    energies, forces, stress = ensemble.energy_forces_stress(model.energy)(
        stacked, positions, cell, neighbors
    )
    efs = petfunc.energy_forces_stress(model.energy)
    for k, member in enumerate(petfunc.tree.unstack(stacked)):
        e, f, s = efs(member, positions, cell, neighbors)
        assert relative(energies[k], e) < 1e-10
        assert relative(forces[k], f) < 1e-10
        assert relative(stress[k][-1], s[-1]) < 1e-10


def test_hessian_equals_cpu():
    """The Hessian (reverse over reverse) on the device equals the CPU's; it is
    symmetric."""
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 8),
        d_pet=16,
        d_node=16,
        d_head=8,
        d_feedforward=16,
        num_heads=2,
        cutoff=4.0,
        num_neighbors_adaptive=6.0,
    )
    model = petfunc.PET(config)
    frames = [ase.build.molecule("CH3CH2OH")]
    frames[0].rattle(0.05, seed=3)
    result = {}
    for device in ("cpu", DEVICE):
        params = model.init(seed=4, dtype=F64, device=device)
        positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=F64, device=device)
        result[str(device)] = petfunc.hessian(model.energy)(params, positions, cell, neighbors)
    h = result[str(DEVICE)]
    assert relative(h, result["cpu"]) < 1e-9
    n = h.shape[0] * 3
    assert relative(h.reshape(n, n), h.reshape(n, n).T) < 1e-9


@pytest.mark.parametrize("compile", [False, True], ids=["eager", "compiled"])
def test_calculator_equals_cpu(compile):
    """The ASE calculator on the device (eager, and compiled with aot_eager) gives the
    CPU's energy, forces and stress."""
    from petfunc.ase import PETCalculator

    config = petfunc.PETConfig(
        atomic_types=(6,), d_pet=16, d_node=16, d_head=8, d_feedforward=16, num_heads=2, cutoff=4.0
    )
    params = petfunc.PET(config).init(seed=5, dtype=F64)
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True).repeat((2, 1, 1))
    atoms.rattle(0.05, seed=1)
    results = {}
    for device, compiled in ((torch.device("cpu"), False), (DEVICE, compile)):  # the reference: CPU, eager
        calc = PETCalculator(
            config,
            petfunc.tree.tree_map(lambda t, device=device: t.to(device), params),
            device=device,
            dtype=F64,
            compile=compiled,
            backend="aot_eager",
        )
        a = atoms.copy()
        a.calc = calc
        results[compiled, str(device)] = (a.get_potential_energy(), a.get_forces(), a.get_stress())
        if compiled:
            for k in range(3):  # MD-like moves: the edge count changes, never a new graph
                a.positions += np.random.default_rng(k).normal(scale=0.05, size=a.positions.shape)
                a.get_forces()
            assert calc.num_compilations == 1
    (e0, f0, s0), (e1, f1, s1) = results[False, "cpu"], results[compile, str(DEVICE)]
    assert abs(e1 - e0) < 1e-10 * abs(e0)
    np.testing.assert_allclose(f1, f0, rtol=0, atol=1e-10 * np.abs(f0).max())
    np.testing.assert_allclose(s1, s0, rtol=0, atol=1e-10 * np.abs(s0).max())


def test_train_cli_compiled(tmp_path):
    """`petfunc train` on the device with compile (aot_eager): the demo trains two
    epochs, with one training and one validation graph, and a restart resumes."""
    import csv

    from petfunc.cli.commands import main

    tiny = [
        "--set",
        "architecture.model.d_pet=16",
        "--set",
        "architecture.model.d_node=16",
        "--set",
        "architecture.model.d_head=8",
        "--set",
        "architecture.model.d_feedforward=16",
        "--set",
        "architecture.model.num_gnn_layers=1",
        "--batch-size",
        "4",
        "--no-progress",
    ]
    out = tmp_path / "run"
    code = main(
        [
            "train",
            "--output",
            str(out),
            "--structures",
            "24",
            "--epochs",
            "2",
            "--device",
            str(DEVICE),
            "--compile",
            "--backend",
            "aot_eager",
            "--dtype",
            "float64",
            *tiny,
        ]
    )
    assert code == 0
    rows = list(csv.DictReader(open(out / "metrics.csv")))
    assert [r["epoch"] for r in rows] == ["1", "2"]
    assert all(np.isfinite(float(r["val_forces_rmse"])) for r in rows)
    ckpt = torch.load(out / "last.ckpt", weights_only=True, map_location="cpu")
    assert ckpt["epoch"] == 2
    more = tmp_path / "more"
    assert (
        main(
            [
                "train",
                "--restart",
                str(out / "last.ckpt"),
                "--epochs",
                "3",
                "--output",
                str(more),
                "--no-progress",
            ]
        )
        == 0
    )
    assert [r["epoch"] for r in csv.DictReader(open(more / "metrics.csv"))] == ["1", "2", "3"]


# the AOTInductor build for a GPU can crash the process that loads it (a segmentation
# fault in torch's AOTIModelPackageLoader on an H200 with torch 2.11): run only when
# asked, in a process of its own (benchmarks/cuda_check.sh does)
CUDA_AOTI = pytest.mark.skipif(
    DEVICE.type == "cuda" and os.environ.get("PETFUNC_TRY_CUDA_AOTI") != "1",
    reason="the CUDA AOTInductor build can crash its loading process; PETFUNC_TRY_CUDA_AOTI=1 runs it",
)


@pytest.mark.parametrize(
    "aoti", [False, pytest.param(True, marks=[pytest.mark.slow, CUDA_AOTI])], ids=["program", "aoti"]
)
def test_export_equals_eager(tmp_path, aoti):
    """`petfunc export` for the device (the exported program, and its AOTInductor
    build) gives the eager energies, forces and strain derivatives on three sizes,
    adaptive cutoff included (float64)."""
    import petfunc.export as pexport
    from petfunc.data import padding_sample
    from petfunc.structures import collate, prepare_atoms

    config = petfunc.PETConfig(
        atomic_types=(1, 6, 8),
        num_neighbors_adaptive=12.0,
        d_pet=16,
        d_node=32,
        d_head=16,
        d_feedforward=32,
        num_heads=2,
    )
    params = petfunc.init(config, seed=3, dtype=F64)
    path = pexport.export(config, params, tmp_path / "model.pt2", dtype=F64, device=DEVICE, aoti=aoti)
    model = pexport.load(path)
    assert model.aoti == aoti
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(config).energy_terms)
    on_device = petfunc.tree.tree_map(lambda t: t.to(DEVICE), params)
    for repeat in ((1, 1, 1), (2, 1, 1), (2, 2, 1)):
        atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True).repeat(repeat)
        atoms.rattle(0.05, seed=1)
        inputs = collate(
            [prepare_atoms(atoms, config), padding_sample(config).structure], config, dtype=F64, device=DEVICE
        )
        for name, a, b in zip(pexport.OUTPUTS, model(*inputs), fn(on_device, *inputs)):
            assert a.device.type == DEVICE.type, name
            assert relative(a, b) < 1e-10, name


@pytest.mark.parametrize(
    "backend",
    [None, "aot_eager", pytest.param("inductor", marks=pytest.mark.slow)],
    ids=["eager", "aot_eager", "inductor"],
)
def test_long_range_calculator_equals_cpu(backend):
    """A long-range PET (P3M: the FFTs of the mesh on the device) in the calculator
    on the device, eager and compiled, gives the CPU's eager energy, forces and
    stress over MD-like moves whose edge counts change, with one graph."""
    from petfunc.ase import PETCalculator

    config = petfunc.PETConfig(
        atomic_types=(1, 6, 8),
        d_pet=16,
        d_node=24,
        d_head=8,
        d_feedforward=16,
        num_heads=2,
        long_range=dict(enable=True),
    )
    params = petfunc.PET(config).init(seed=6, dtype=F64)
    cpu = PETCalculator(config, params, dtype=F64)
    dev = PETCalculator(
        config,
        petfunc.tree.tree_map(lambda t: t.to(DEVICE), params),
        device=DEVICE,
        dtype=F64,
        compile=backend is not None,
        backend=backend or "inductor",
    )
    cell = [[4.2, 0.1, 0.3], [0.8, 4.6, 0.0], [0.2, 0.5, 5.1]]
    atoms = ase.Atoms(
        "CHOCH",
        positions=[[0, 0, 0], [1.1, 0.3, 0.2], [0.5, 1.4, 0.9], [2.5, 2.2, 2.4], [3.1, 3.0, 2.0]],
        cell=cell,
        pbc=True,
    )
    edges = set()
    for k in range(3):
        atoms.positions += np.random.default_rng(k).normal(scale=0.08, size=atoms.positions.shape)
        for calc in (cpu, dev):
            calc.calculate(atoms, ["energy", "forces", "stress"])
        edges.add(int(petfunc.from_atoms([atoms], config)[2].centers.shape[0]))
        for key in ("energy", "forces", "stress"):
            a, b = np.asarray(dev.results[key]), np.asarray(cpu.results[key])
            assert np.abs(a - b).max() <= 1e-10 * max(1.0, np.abs(b).max()), (key, k)
    assert len(edges) > 1
    if backend is not None:
        assert dev.num_compilations == 1
