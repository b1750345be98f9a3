"""The ASE calculator in ASE's simulations: a geometry optimisation converges, NVE
molecular dynamics conserves the total energy, and the compiled calculator
(``backend="aot_eager"``) compiles once over 200 MD steps whose neighbour counts
change, for other structures and sizes, and for a committee. The 1000-step NVE run
is ``@pytest.mark.slow``."""

import ase
import ase.build
import numpy as np
import pytest
from ase import units
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.md.verlet import VelocityVerlet
from ase.optimize import BFGS

from petfunc.ase import PETCalculator
from petfunc.structures import prepare_atoms
from tests.helpers.ase_setup import CONFIG, carbon_cell, committee, ethanol, relative, slab


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
    with the same numbers (other keys: the tests of petfunc.compile's trace cache)."""
    atoms = carbon_cell()
    atoms.calc = compiled
    first = atoms.get_potential_energy()
    assert not compiled._compiled[None].from_cache  # one graph: no long-range mesh layout
    atoms.calc = PETCalculator(CONFIG, params, compile=True, backend="aot_eager")
    assert atoms.get_potential_energy() == first
    assert atoms.calc._compiled[None].from_cache


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
