"""The ASE calculator (petfunc.ase.PETCalculator).

* parity with metatomic's ASE calculator running metatrain's exported PET on the same
  weights (float64): energy, per-atom energies, forces, stress;
* NVE molecular dynamics conserves the total energy, a geometry optimisation converges;
* the compiled path (``backend="aot_eager"``) compiles once over 200 MD steps whose
  neighbour counts change, and for other structures, sizes and committees;
* unknown species, stress of a molecule, committee uncertainties, constructors.

The model is a small random PET (seed 1, which has a stable, relaxed diamond-like
8-atom minimum). The 1000-step NVE run is ``@pytest.mark.slow``.
"""

import warnings

import ase
import ase.build
import ase.io
import numpy as np
import pytest
import torch
from ase import units
from ase.calculators.calculator import PropertyNotImplementedError
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS

import petfunc
from petfunc.ase import PETCalculator
from petfunc.structures import prepare_atoms


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)
CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
COMPOSITION = [-13.6, -1029.8, -1485.3, -2042.6]  # roughly eV per H, C, N, O


def make_params(config=CONFIG, seed=1):
    params = petfunc.init(config, seed=seed, dtype=torch.float64)
    params["composition_weights"] = torch.tensor(COMPOSITION, dtype=torch.float64)
    return params


@pytest.fixture(scope="module")
def params():
    return make_params()


# ---------------------------------------------------------------------------------------
# structures


def ethanol():
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=1)
    return atoms


def carbon_cell():
    """8-atom cubic diamond cell with two N, rattled."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.symbols[[1, 6]] = "N"
    atoms.rattle(0.08, seed=4)
    return atoms


def triclinic_cell():
    """A small, skewed cell (lattice vectors shorter than the cutoff)."""
    atoms = ase.Atoms(
        "CCOH",
        positions=[[0.1, 0.0, 0.2], [1.4, 0.9, 0.3], [0.6, 1.7, 1.2], [1.9, 0.3, 1.6]],
        cell=[[2.9, 0.1, 0.0], [0.6, 2.8, 0.2], [0.3, -0.4, 3.1]],
        pbc=True,
    )
    return atoms


def slab():
    """pbc (T, T, F) with 8 Å of vacuum in the (non-periodic) third cell row."""
    atoms = ase.Atoms(
        "CCOCH",
        positions=[[0.0, 0.0, 0.0], [1.3, 1.2, 0.1], [0.1, 1.4, 1.3], [1.5, 0.2, 1.4], [0.8, 0.7, 2.5]],
        cell=[[2.6, 0.0, 0.0], [0.4, 2.7, 0.0], [0.0, 0.0, 10.0]],
        pbc=[True, True, False],
    )
    atoms.rattle(0.03, seed=5)
    return atoms


def relative(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


# ---------------------------------------------------------------------------------------
# parity with metatomic's calculator


def metatomic_calculator(config, params):
    pytest.importorskip("metatrain")
    metatomic_ase = pytest.importorskip("metatomic_ase")
    from helpers import mtt_reference as ref

    model = ref.make_model(config)
    ref.load_params(model, params)
    return metatomic_ase.MetatomicCalculator(model.export(), device="cpu")


@pytest.fixture(scope="module")
def metatomic(params):
    return metatomic_calculator(CONFIG, params)


PARITY_RTOL = 1e-9


def compare_with_metatomic(reference, calc, atoms, stress=True):
    a, b = atoms.copy(), atoms.copy()
    a.calc, b.calc = reference, calc
    # energies compared without the (identical, large) composition term
    comp = np.array(COMPOSITION)[[CONFIG.atomic_types.index(z) for z in atoms.numbers]]
    errors = {
        "energy": relative(b.get_potential_energy() - comp.sum(), a.get_potential_energy() - comp.sum()),
        "free_energy": relative(
            b.calc.get_property("free_energy", b) - comp.sum(), a.get_potential_energy() - comp.sum()
        ),
        "energies": relative(b.get_potential_energies() - comp, a.get_potential_energies() - comp),
        "forces": relative(b.get_forces(), a.get_forces()),
    }
    if stress:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            errors["stress"] = relative(b.get_stress(), a.get_stress())
    return errors


def test_charge_and_spin_conditioning_matches_metatomic():
    """A model with charge/spin conditioning (random, non-zero gate) reads
    ``atoms.info`` as metatomic's calculator does, and changing the charge or spin
    invalidates the cached results."""
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), system_conditioning=True, **SMALL)
    params = make_params(config, seed=2)
    generator = torch.Generator().manual_seed(0)
    gate = params["system_conditioning"]["project"]["2"]
    for name in gate:
        gate[name] = torch.randn(gate[name].shape, generator=generator, dtype=torch.float64) / 4
    reference = metatomic_calculator(config, params)
    atoms = carbon_cell()
    atoms.calc = PETCalculator(config, params)  # stays attached while info changes
    energies = []
    for info in ({}, {"charge": 1}, {"charge": -2, "spin_multiplicity": 3}, {"charge": -2, "spin": 2}):
        atoms.info.clear()
        atoms.info.update(info)
        errors = compare_with_metatomic(reference, PETCalculator(config, params), atoms)
        assert max(errors.values()) < PARITY_RTOL, (info, errors)
        fresh = atoms.copy()
        fresh.calc = PETCalculator(config, params)
        energies.append(atoms.get_potential_energy())  # recomputed: info changed
        assert energies[-1] == fresh.get_potential_energy()
    assert len(set(energies)) == 4
    atoms.info["charge"] = 11
    with pytest.raises(ValueError, match=r"charge 11 is outside the model's range \[-10, 10\]"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("structure", [ethanol, carbon_cell, triclinic_cell, slab])
def test_matches_metatomic_calculator(structure, params, metatomic):
    atoms = structure()
    stress = bool(atoms.cell.volume > 0)
    errors = compare_with_metatomic(metatomic, PETCalculator(CONFIG, params), atoms, stress)
    assert max(errors.values()) < PARITY_RTOL, errors


def test_matches_metatomic_calculator_default_architecture():
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    params = make_params(config, seed=0)
    reference = metatomic_calculator(config, params)
    for atoms in (ethanol(), carbon_cell()):
        errors = compare_with_metatomic(reference, PETCalculator(config, params), atoms, atoms.pbc.all())
        assert max(errors.values()) < PARITY_RTOL, errors


def test_stress_conventions(params):
    # Voigt order, sign and symmetrisation from the strain derivative, V = ASE volume
    atoms = carbon_cell()
    calc = PETCalculator(CONFIG, params)
    atoms.calc = calc
    efs = petfunc.energy_forces_strain_derivative(petfunc.PET(CONFIG).energy)
    _, _, de_deps = efs(params, *petfunc.from_atoms(atoms, CONFIG, dtype=torch.float64))
    sigma = de_deps[0].numpy() / atoms.get_volume()
    sigma = (sigma + sigma.T) / 2
    expected = [sigma[0, 0], sigma[1, 1], sigma[2, 2], sigma[1, 2], sigma[0, 2], sigma[0, 1]]
    np.testing.assert_allclose(atoms.get_stress(), expected, rtol=1e-12, atol=1e-15)
    # finite strain: sigma_aa = (1/V) dE/d eps_aa
    h = 1e-5
    energies = []
    for sign in (1, -1):
        strained = atoms.copy()
        strained.calc = calc
        strained.set_cell(atoms.cell[:] @ np.diag([1 + sign * h, 1, 1]), scale_atoms=True)
        energies.append(strained.get_potential_energy())
    numeric = (energies[0] - energies[1]) / (2 * h) / atoms.get_volume()
    assert abs(numeric - atoms.get_stress()[0]) < 1e-6 * max(1.0, abs(numeric))


def test_molecule_has_no_stress(params):
    atoms = ethanol()
    atoms.calc = PETCalculator(CONFIG, params)
    atoms.get_forces()
    with pytest.raises(PropertyNotImplementedError, match="zero volume"):
        atoms.get_stress()


def test_energies_sum_to_energy(params):
    for atoms in (ethanol(), carbon_cell()):
        atoms.calc = PETCalculator(CONFIG, params)
        assert atoms.get_potential_energies().shape == (len(atoms),)
        np.testing.assert_allclose(
            atoms.get_potential_energies().sum(), atoms.get_potential_energy(), rtol=1e-13
        )


def test_one_model_call_gives_every_result(params, monkeypatch):
    """Per-atom energies come with every calculation: asking for them after the
    forces and stress does not evaluate the model again."""
    atoms = carbon_cell()
    atoms.calc = PETCalculator(CONFIG, params)
    calls = []
    evaluate = atoms.calc._evaluate
    monkeypatch.setattr(atoms.calc, "_evaluate", lambda *a: calls.append(1) or evaluate(*a))
    atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
    energies = atoms.get_potential_energies()
    assert len(calls) == 1 and energies.sum() == pytest.approx(atoms.get_potential_energy(), rel=1e-13)


def test_implemented_properties_follow_the_model(params):
    """A plain calculator does not offer uncertainties (asking for one computed
    everything, then raised); a committee offers them all, LLPR without ensemble
    weights only the energy's."""
    plain = PETCalculator(CONFIG, params)
    assert (
        "energy_uncertainty" not in plain.implemented_properties
        and "energies" in plain.implemented_properties
    )
    atoms = carbon_cell()
    atoms.calc = plain
    with pytest.raises(PropertyNotImplementedError):
        atoms.calc.get_property("energy_uncertainty", atoms)
    committee_calc = PETCalculator(CONFIG, params, ensemble_params=committee())
    assert {
        "energy_uncertainty",
        "forces_uncertainty",
        "stress_uncertainty",
        "energy_ensemble",
        "forces_ensemble",
    } <= set(committee_calc.implemented_properties)
    llpr = PETCalculator(CONFIG, params, llpr={"covariance": torch.eye(3, dtype=torch.float64)})
    assert (
        llpr.implemented_properties[-1] == "energy_uncertainty"
        and "forces_uncertainty" not in llpr.implemented_properties
    )
    assert PETCalculator.implemented_properties == ["energy", "free_energy", "energies", "forces", "stress"]


def test_float32_atoms_far_from_the_cell(params):
    """A float32 model sees the atoms wrapped into the cell (in float64): atoms that
    diffused 100 cells away give the forces of the wrapped structure. Unwrapped,
    the float32 edge vectors lost ~1e-4 eV/Å at 700 Å from the origin."""
    params32 = petfunc.tree.tree_map(lambda x: x.float(), params)
    atoms = carbon_cell()
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    f64, s64 = reference.get_forces(), reference.get_stress()
    far = atoms.copy()
    far.positions += np.array([100, -70, 30]) @ atoms.cell.array + atoms.cell.array[0] * 0.5
    far.calc = PETCalculator(CONFIG, params32)
    assert np.abs(far.get_forces() - f64).max() < 2e-5
    assert np.abs(far.get_stress() - s64).max() < 1e-6
    assert np.allclose(far.positions, atoms.positions + np.array([100.5, -70, 30]) @ atoms.cell.array)
    from petfunc.ase import BatchEvaluator

    (batched,) = BatchEvaluator(CONFIG, params32, stress=True)([far])
    assert np.abs(batched["forces"] - f64).max() < 2e-5 and np.abs(batched["stress"] - s64).max() < 1e-6
    # a slab moves only along its periodic directions
    structure = prepare_atoms(far, CONFIG, wrap=True)
    frac = np.linalg.solve(atoms.cell.array.T, structure.positions.T).T
    assert frac.min() > -1e-9 and frac.max() < 1 + 1e-9
    flat = far.copy()
    flat.pbc = [True, True, False]
    structure = prepare_atoms(flat, CONFIG, wrap=True)
    frac = np.linalg.solve(atoms.cell.array.T, structure.positions.T).T
    assert frac[:, :2].min() > -1e-9 and frac[:, :2].max() < 1 + 1e-9
    np.testing.assert_allclose(
        frac[:, 2], np.linalg.solve(atoms.cell.array.T, far.positions.T).T[:, 2], atol=1e-9
    )


def test_unknown_species(params):
    atoms = ase.build.bulk("Si", "diamond", a=5.43)
    atoms.calc = PETCalculator(CONFIG, params)
    with pytest.raises(ValueError, match=r"Si \(Z=14\).*H, C, N, O"):
        atoms.get_potential_energy()


# ---------------------------------------------------------------------------------------
# geometry optimisation and molecular dynamics


@pytest.fixture(scope="module")
def relaxed(params):
    """The 8-atom diamond cell relaxed (BFGS) with the random model."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.rattle(0.02, seed=1)
    atoms.calc = PETCalculator(CONFIG, params)
    optimizer = BFGS(atoms, logfile=None)
    converged = optimizer.run(fmax=1e-3, steps=200)
    return atoms, converged, optimizer.nsteps


def test_geometry_optimisation_converges(relaxed):
    atoms, converged, steps = relaxed
    assert converged, f"BFGS did not reach fmax=1e-3 in {steps} steps"
    assert np.abs(atoms.get_forces()).max() < 1e-3
    distances = atoms.get_all_distances(mic=True)[np.triu_indices(len(atoms), 1)]
    assert distances.min() > 1.0, "the relaxed structure collapsed"


def run_nve(atoms, calc, timestep_fs, steps, temperature_K=300.0, seed=0):
    """Total energy per atom along a VelocityVerlet run, relative to the start."""
    atoms = atoms.copy()
    atoms.calc = calc
    MaxwellBoltzmannDistribution(atoms, temperature_K=temperature_K, rng=np.random.default_rng(seed))
    Stationary(atoms)
    dynamics = VelocityVerlet(atoms, timestep_fs * units.fs)
    totals = []
    dynamics.attach(lambda: totals.append(atoms.get_total_energy()), interval=1)
    dynamics.run(steps)
    totals = np.array(totals)
    return (totals - totals[0]) / len(atoms), atoms


# Measured (seed-1 model, relaxed 8-atom cell, 300 K start, 0.5 fs, float64): the total
# energy fluctuates within 1.29e-5 eV/atom of E(0) after 100 steps and still after 1000
# steps (0.5 ps); the mean over the second half of the 1000 steps differs from the
# first half's by 4e-8 eV/atom (no drift). With 1 fs the fluctuation is 5.2e-5 eV/atom.
MD_BOUND = 2e-5  # eV/atom, max |E_tot(t) - E_tot(0)|
DRIFT_BOUND = 1e-6  # eV/atom, mean(second half) - mean(first half)


def test_nve_conserves_energy(relaxed, params):
    deviation, atoms = run_nve(relaxed[0], PETCalculator(CONFIG, params), 0.5, 100)
    assert np.abs(deviation).max() < MD_BOUND, np.abs(deviation).max()
    assert 50 < atoms.get_temperature() < 1000


@pytest.mark.slow
def test_nve_conserves_energy_1000_steps(relaxed, params):
    deviation, atoms = run_nve(relaxed[0], PETCalculator(CONFIG, params), 0.5, 1000)
    assert np.abs(deviation).max() < MD_BOUND, np.abs(deviation).max()
    drift = deviation[500:].mean() - deviation[:500].mean()
    assert abs(drift) < DRIFT_BOUND, drift
    assert 50 < atoms.get_temperature() < 1000


# ---------------------------------------------------------------------------------------
# compiled path


@pytest.fixture(scope="module")
def compiled(params):
    return PETCalculator(CONFIG, params, compile=True, backend="aot_eager")


def test_compiled_md_compiles_once(relaxed, params, compiled):
    assert compiled.num_compilations == 0
    atoms = relaxed[0].copy()
    atoms.calc = compiled
    MaxwellBoltzmannDistribution(atoms, temperature_K=1500.0, rng=np.random.default_rng(1))
    Stationary(atoms)
    dynamics = VelocityVerlet(atoms, 1.0 * units.fs)
    edges = []
    dynamics.attach(lambda: edges.append(len(prepare_atoms(atoms, CONFIG).centers)), interval=1)
    dynamics.run(200)
    assert compiled.num_compilations == 1
    assert len(set(edges)) >= 5, f"neighbour counts did not change enough: {sorted(set(edges))}"

    # compiled == eager on the last frame, on other sizes, a molecule and a slab
    eager = PETCalculator(CONFIG, params)
    for frame in (atoms, carbon_cell(), ethanol(), slab(), ase.Atoms("H", positions=[[0, 0, 0]])):
        a, b = frame.copy(), frame.copy()
        a.calc, b.calc = compiled, eager
        assert relative(a.get_potential_energy(), b.get_potential_energy()) < 1e-12
        np.testing.assert_allclose(a.get_forces(), b.get_forces(), rtol=0, atol=1e-10)
        if frame.pbc.all():
            np.testing.assert_allclose(a.get_stress(), b.get_stress(), rtol=0, atol=1e-10)
    assert compiled.num_compilations == 1


def test_compiled_calculator_reuses_its_trace(params, compiled):
    """A second compiled calculator of the same config (as in a new process) loads
    the trace of the first from the cache (the test run's folder, tests/conftest.py),
    with the same numbers (other keys: tests/test_compile.py)."""
    atoms = carbon_cell()
    atoms.calc = compiled
    first = atoms.get_potential_energy()
    assert not compiled._compiled[None].from_cache  # one graph: no long-range mesh layout
    atoms.calc = PETCalculator(CONFIG, params, compile=True, backend="aot_eager")
    assert atoms.get_potential_energy() == first
    assert atoms.calc._compiled[None].from_cache


def committee(n=3):
    return [make_params(seed=seed) for seed in range(2, 2 + n)]


def test_compiled_committee_does_not_recompile(params, compiled):
    members = committee()
    compiled.ensemble_params = members
    try:
        atoms = carbon_cell()
        atoms.calc = compiled
        atoms.get_potential_energy()
        got = compiled.results
        expected = PETCalculator(CONFIG, params, ensemble_params=members)
        expected.calculate(atoms.copy(), ["energy", "forces", "stress"])
        for key in ("energy_ensemble", "forces_ensemble", "energy_uncertainty", "forces_uncertainty"):
            np.testing.assert_allclose(got[key], expected.results[key], rtol=1e-10, atol=1e-10)
    finally:
        compiled.ensemble_params = None
    assert compiled.num_compilations <= 1


# ---------------------------------------------------------------------------------------
# committee (eager: torch.func.vmap over the members)


def test_committee_uncertainty(params):
    members = committee()
    atoms = carbon_cell()
    atoms.calc = PETCalculator(CONFIG, params, ensemble_params=petfunc.tree.stack(members))
    energy = atoms.get_potential_energy()
    results = atoms.calc.results

    # a loop over single-member calculators
    singles = []
    for member in members:
        a = atoms.copy()
        a.calc = PETCalculator(CONFIG, member)
        singles.append((a.get_potential_energy(), a.get_forces(), a.get_stress()))
    energies = np.array([s[0] for s in singles])
    forces = np.stack([s[1] for s in singles])
    stresses = np.stack([s[2] for s in singles])

    assert results["energy_ensemble"].shape == (3,)
    assert results["forces_ensemble"].shape == (3, len(atoms), 3)
    assert results["forces_uncertainty"].shape == (len(atoms), 3)
    assert results["stress_uncertainty"].shape == (6,)
    np.testing.assert_allclose(results["energy_ensemble"], energies, rtol=1e-12)
    np.testing.assert_allclose(results["forces_ensemble"], forces, rtol=0, atol=1e-11)
    np.testing.assert_allclose(atoms.calc.get_property("energy_uncertainty"), energies.std(), rtol=1e-10)
    np.testing.assert_allclose(results["forces_uncertainty"], forces.std(axis=0), rtol=0, atol=1e-11)
    np.testing.assert_allclose(results["stress_uncertainty"], stresses.std(axis=0), rtol=0, atol=1e-11)
    # the prediction is the main model's
    main = atoms.copy()
    main.calc = PETCalculator(CONFIG, params)
    assert energy == pytest.approx(main.get_potential_energy(), rel=1e-14)

    # without main params, the committee mean is the prediction
    mean = atoms.copy()
    mean.calc = PETCalculator(CONFIG, None, ensemble_params=members)
    assert mean.get_potential_energy() == pytest.approx(energies.mean(), rel=1e-12)
    np.testing.assert_allclose(mean.get_forces(), forces.mean(axis=0), rtol=0, atol=1e-11)
    np.testing.assert_allclose(mean.get_potential_energies().sum(), energies.mean(), rtol=1e-12)


# ---------------------------------------------------------------------------------------
# constructors


def test_from_checkpoint(tmp_path, params):
    path = tmp_path / "model.pt"
    petfunc.save_params(path, CONFIG, params)
    atoms = carbon_cell()
    atoms.calc = PETCalculator.from_checkpoint(path)
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    assert atoms.get_potential_energy() == reference.get_potential_energy()

    # a training checkpoint (petfunc train's): its best parameters are used
    training = tmp_path / "training.ckpt"
    other = make_params(seed=5)
    petfunc.io.write_checkpoint(
        training,
        config=CONFIG,
        params=other,
        opt_state=(),
        epoch=3,
        step=30,
        best_epoch=2,
        best_metric=0.5,
        best_params=params,
        composition=params["composition_weights"],
        energy_scale=float(params["energy_scale"]),
        dtype=torch.float64,
        seed=0,
        options={},
        history=[],
        split={},
        world_size=1,
        version=petfunc.__version__,
    )
    atoms.calc = PETCalculator.from_checkpoint(training)
    assert atoms.get_potential_energy() == reference.get_potential_energy()

    junk = tmp_path / "junk.pt"
    torch.save({"something": torch.zeros(2)}, junk)
    with pytest.raises(ValueError, match="from_metatrain"):
        PETCalculator.from_checkpoint(junk)


def test_from_metatrain_exported_model(tmp_path, params, metatomic):
    path = tmp_path / "exported.pt"
    metatomic.model().save(str(path))
    atoms = carbon_cell()
    atoms.calc = PETCalculator.from_metatrain(path)
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    assert atoms.calc.config == CONFIG
    assert relative(atoms.get_forces(), reference.get_forces()) < 1e-12


# ---------------------------------------------------------------------------------------
# example


@pytest.mark.slow
def test_md_example_smoke(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parents[1] / "examples" / "md.py"
    output = tmp_path / "md.extxyz"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RANDOM parameters" in result.stdout
    frames = ase.io.read(output, index=":")
    assert len(frames) == 5 and "forces" in frames[-1].calc.results


def test_calculator_pickles_and_exports_properties(params):
    """A calculator travels to other processes (a multiprocessing pool): pickling
    failed on its derivative closures. The copy gives the same numbers, a committee
    included."""
    import pickle

    atoms = ase.build.molecule("CH3CH2OH")
    for calc in (
        PETCalculator(CONFIG, params),
        PETCalculator(
            CONFIG, params, ensemble_params=[params, petfunc.PET(CONFIG).init(seed=5, dtype=torch.float64)]
        ),
    ):
        if calc.ensemble_params is not None:  # ASE's Properties refused energy_ensemble
            a = atoms.copy()
            a.calc = calc
            assert a.get_properties(["energy"])["energy"] == a.get_potential_energy()
        copy = pickle.loads(pickle.dumps(calc))
        for key in ("energy", "forces"):
            a, b = atoms.copy(), atoms.copy()
            a.calc, b.calc = calc, copy
            np.testing.assert_array_equal(a.calc.get_property(key, a), b.calc.get_property(key, b))
