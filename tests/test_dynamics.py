"""Batched MD (petfunc.dynamics.run) against ASE's VelocityVerlet and Langevin with the
petfunc calculator, step for step."""

import warnings

import ase.build
import numpy as np
import pytest
import torch
from ase import units
from ase.constraints import FixAtoms
from ase.md.langevin import Langevin as AseLangevin
from ase.md.verlet import VelocityVerlet as AseVerlet

import petfunc
from petfunc.ase import PETCalculator
from petfunc.dynamics import Langevin, run


CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 8, 29),
    cutoff=4.0,
    d_pet=8,
    d_head=8,
    d_node=16,
    d_feedforward=16,
    num_heads=2,
    num_gnn_layers=1,
    num_attention_layers=1,
)


@pytest.fixture(scope="module")
def params():
    params = petfunc.PET(CONFIG).init(seed=5, dtype=torch.float64)
    params["energy_scale"].fill_(3.0)
    return params


def _structures():
    ethanol = ase.build.molecule("CH3CH2OH")
    copper = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True)
    copper.rattle(0.05, seed=3)
    methanol = ase.build.molecule("CH3OH")
    methanol.set_constraint(FixAtoms(indices=[0]))
    frames = [ethanol, copper, methanol]
    for i, atoms in enumerate(frames):  # Maxwell-Boltzmann momenta at 300 K
        masses = atoms.get_masses()[:, None]
        rng = np.random.default_rng(10 + i)
        atoms.set_momenta(rng.standard_normal((len(atoms), 3)) * np.sqrt(masses * units.kB * 300))
    return frames


def _ase_run(atoms, params, make, steps):
    atoms = atoms.copy()
    atoms.calc = PETCalculator(CONFIG, params)
    dynamics = make(atoms)
    energies = []  # ASE calls its observers at step 0 too
    dynamics.attach(lambda: energies.append(atoms.get_potential_energy()), interval=1)
    dynamics.run(steps)
    return atoms, np.array(energies[: steps + 1])


def _compare(result, references):
    for k, (atoms, (reference, energies)) in enumerate(zip(result.atoms, references)):
        np.testing.assert_allclose(atoms.positions, reference.positions, atol=1e-9)
        np.testing.assert_allclose(atoms.get_momenta(), reference.get_momenta(), atol=1e-9)
        np.testing.assert_allclose(result.potential_energy[:, k], energies, atol=1e-9)
        assert result.kinetic_energy[-1, k] == pytest.approx(reference.get_kinetic_energy(), abs=1e-9)


@pytest.mark.parametrize("max_atoms", [None, 10])
def test_velocity_verlet_follows_ase(params, max_atoms):
    """Every structure, in one batch (or batches of at most 10 atoms), takes ASE's
    VelocityVerlet trajectory: positions, momenta and energies to 1e-9; a fixed atom
    stays put; the observer sees every step."""
    frames = _structures()
    seen = []
    result = run(
        CONFIG,
        params,
        frames,
        steps=25,
        timestep=0.5 * units.fs,
        max_atoms=max_atoms,
        observer=lambda step, atoms: seen.append((step, atoms[1].get_potential_energy())),
    )
    references = [_ase_run(a, params, lambda x: AseVerlet(x, 0.5 * units.fs), 25) for a in frames]
    _compare(result, references)
    assert [s for s, _ in seen] == list(range(26))
    np.testing.assert_allclose([e for _, e in seen], result.potential_energy[:, 1], atol=0)
    np.testing.assert_array_equal(result.atoms[2].positions[0], frames[2].positions[0])
    assert not np.allclose(result.atoms[0].positions, frames[0].positions, atol=1e-3)
    total = result.potential_energy + result.kinetic_energy
    assert np.abs(total[:, 1] - total[0, 1]).max() < 1e-8  # NVE: the copper cell's total energy
    assert np.ptp(result.kinetic_energy[:, 1]) > 1e-5  # while its kinetic energy moves


@pytest.mark.parametrize("fix_com", [False, True])
def test_langevin_follows_ase(params, fix_com):
    """Langevin with the same random generators as ASE's takes its trajectory."""
    frames = _structures()[:2]
    thermostat = Langevin(temperature_K=500, friction=0.02 / units.fs, fix_com=fix_com)
    result = run(
        CONFIG,
        params,
        frames,
        steps=20,
        timestep=0.5 * units.fs,
        integrator=thermostat,
        rngs=[np.random.default_rng(i) for i in range(2)],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # ASE's fixcm deprecation
        references = [
            _ase_run(
                a,
                params,
                lambda x, i=i: AseLangevin(
                    x,
                    0.5 * units.fs,
                    temperature_K=500,
                    friction=0.02 / units.fs,
                    fixcm=fix_com,
                    rng=np.random.default_rng(i),
                ),
                20,
            )
            for i, a in enumerate(frames)
        ]
    _compare(result, references)
    # another seed, another trajectory
    other = run(CONFIG, params, frames, steps=5, timestep=0.5 * units.fs, integrator=thermostat, seed=1)
    again = run(CONFIG, params, frames, steps=5, timestep=0.5 * units.fs, integrator=thermostat, seed=1)
    np.testing.assert_array_equal(other.atoms[0].positions, again.atoms[0].positions)
    assert not np.allclose(other.atoms[0].positions, result.atoms[0].positions)


def test_compiled_dynamics_one_graph(params):
    pytest.importorskip("torch._dynamo")
    frames = _structures()
    eager = run(CONFIG, params, frames, steps=8, timestep=0.5 * units.fs)
    compiled = run(
        CONFIG,
        params,
        frames,
        steps=8,
        timestep=0.5 * units.fs,
        compile=True,
        backend="aot_eager",
        max_atoms=10,
    )
    assert compiled.compiled_graphs == 1 and eager.compiled_graphs == 0
    np.testing.assert_allclose(compiled.potential_energy, eager.potential_energy, atol=1e-9)


def test_dynamics_arguments(params):
    frames = _structures()[:1]
    for bad, error in (
        ({"steps": -1}, ValueError),
        ({"timestep": 0.0}, ValueError),
        ({"integrator": "langevin"}, TypeError),
        ({"integrator": Langevin(300, 0.01), "rngs": [np.random.default_rng(0)] * 2}, ValueError),
    ):
        with pytest.raises(error):
            run(CONFIG, params, frames, **{"steps": 2, "timestep": 1.0, **bad})
    with pytest.raises(ValueError, match="temperature_K"):
        Langevin(-1.0, 0.01)
    with pytest.raises(ValueError, match=r"structure 0: atomic number\(s\) \[7\] are not among"):
        run(CONFIG, params, [ase.build.molecule("NH3")], steps=1, timestep=1.0)


def test_float32_far_from_the_origin(params):
    """A molecule at 1e6 Å moves in float32 as it does at the origin in float64, and
    stays in the user's frame."""
    near = _structures()[0]
    far = near.copy()
    far.positions += [1e6, 0.0, 0.0]
    params32 = petfunc.tree.tree_map(lambda x: x.float(), params)
    reference = run(CONFIG, params, [near], steps=6, timestep=1.0 * units.fs)
    moved = run(CONFIG, params32, [far], steps=6, timestep=1.0 * units.fs)
    np.testing.assert_allclose(
        moved.atoms[0].positions - [1e6, 0.0, 0.0], reference.atoms[0].positions, atol=1e-5
    )
    np.testing.assert_allclose(moved.potential_energy, reference.potential_energy, rtol=1e-5)
