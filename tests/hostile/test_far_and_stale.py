"""Structures far from the origin in float32, and neighbour lists reused after the
atoms moved.

A float32 model must give the float64 numbers (1e-5 relative) for a molecule at
1e6 Å and for a crystal moved by 1e4 cell vectors, through :func:`petfunc.from_atoms`,
the ASE calculator and training batches; the paths that could reuse a neighbour list
(the calculator, relaxations, dynamics, ``collate`` given new positions) rebuild it
or refuse a stale one.
"""

import numpy as np
import pytest
import torch

import petfunc
from petfunc.ase import PETCalculator
from petfunc.data import make_batch, sample_from_atoms
from petfunc.derivatives import energy_forces_strain_derivative
from petfunc.dynamics import run
from petfunc.relax import fire
from tests.helpers.ase_setup import CONFIG, carbon_cell, ethanol, make_params


TOLERANCE = 1e-5  # relative: float32 against float64


@pytest.fixture(scope="module")
def params():
    return make_params()


@pytest.fixture(scope="module")
def params32(params):
    return petfunc.tree.tree_map(lambda x: x.float(), params)


def _evaluate(params, inputs):
    """``(energies, forces, strain derivatives)`` as float64 numpy."""
    efs = energy_forces_strain_derivative(petfunc.PET(CONFIG).energy, "autograd")
    return [x.detach().double().numpy() for x in efs(params, *inputs)]


def _assert_close(got, reference):
    """Energies, forces (and strain derivatives) within TOLERANCE of the reference,
    relative to its largest entry."""
    for name, a, b in zip(("energy", "forces", "strain derivative"), got, reference):
        error = np.abs(a - b).max() / np.abs(b).max()
        assert error < TOLERANCE, f"{name}: relative error {error:.3g}"


def _far_molecule():
    far = ethanol()
    far.positions += [1e6, 0.0, 0.0]
    return far


def _far_crystal():
    far = carbon_cell()
    far.positions += np.array([1e4, -1e4, 1e4]) @ far.cell.array
    return far


@pytest.mark.parametrize(
    "make", [(ethanol, _far_molecule), (carbon_cell, _far_crystal)], ids=["1e6 A", "1e4 cells"]
)
def test_far_structure_float32_from_atoms(params, params32, make):
    near, far = make
    reference = _evaluate(params, petfunc.from_atoms(near(), CONFIG, dtype=torch.float64))
    got = _evaluate(params32, petfunc.from_atoms(far(), CONFIG, dtype=torch.float32))
    _assert_close(got[:2] if not far().pbc.all() else got, reference)


def test_diffused_atoms_float32_from_atoms(params, params32):
    """Each atom moved by its own (large) number of cell vectors, as in an unwrapped
    trajectory."""
    atoms = carbon_cell()
    reference = _evaluate(params, petfunc.from_atoms(atoms, CONFIG, dtype=torch.float64))
    rng = np.random.default_rng(0)
    diffused = atoms.copy()
    diffused.positions += rng.integers(-10_000, 10_000, size=(len(atoms), 3)) @ atoms.cell.array
    _assert_close(_evaluate(params32, petfunc.from_atoms(diffused, CONFIG, dtype=torch.float32)), reference)


@pytest.mark.parametrize(
    "make", [(ethanol, _far_molecule), (carbon_cell, _far_crystal)], ids=["1e6 A", "1e4 cells"]
)
def test_far_structure_float32_calculator(params, params32, make):
    near, far = make
    reference = near()
    reference.calc = PETCalculator(CONFIG, params)
    atoms = far()
    given = atoms.positions.copy()
    atoms.calc = PETCalculator(CONFIG, params32)
    error = np.abs(atoms.get_forces() - reference.get_forces()).max() / np.abs(reference.get_forces()).max()
    assert error < TOLERANCE
    energy = reference.get_potential_energy()
    assert abs(atoms.get_potential_energy() - energy) < TOLERANCE * abs(energy)
    # the calculator does not move the user's atoms
    assert np.array_equal(atoms.positions, given)


def test_far_molecule_float32_training_batch(params, params32):
    """Training data far from the origin: the batch's model inputs give the float64
    predictions; the labels are those of the file."""
    near, far = ethanol(), _far_molecule()
    reference = _evaluate(params, petfunc.from_atoms(near, CONFIG, dtype=torch.float64))
    sample = sample_from_atoms(far, CONFIG, energy_key=None, forces_key=None, stress_key=None)
    batch = make_batch([sample], CONFIG, np.zeros(CONFIG.num_species), 1.0, dtype=torch.float32)
    energies, forces, _ = _evaluate(params32, (batch.positions, batch.cell, batch.neighbors))
    n = len(near)
    _assert_close((energies[:1], forces[:n]), reference[:2])
    # the stored structure keeps the positions of the file
    assert np.array_equal(sample.structure.positions, far.positions)


def test_far_molecule_float32_relax_and_dynamics(params, params32):
    """Relaxation and dynamics in float32 at 1e6 Å follow float64, and return the
    structures in the user's frame."""
    near, far = ethanol(), _far_molecule()
    shift = far.positions - near.positions
    relaxed = [fire(CONFIG, p, [a], steps=5).atoms[0] for p, a in ((params, near), (params32, far))]
    assert np.abs(relaxed[1].positions - shift - relaxed[0].positions).max() < 1e-6
    moved = [
        run(CONFIG, p, [a], steps=5, timestep=0.5).atoms[0] for p, a in ((params, near), (params32, far))
    ]
    assert np.abs(moved[1].positions - shift - moved[0].positions).max() < 1e-6
    assert np.abs(moved[1].positions[:, 0] - 1e6).max() < 10.0


# ---------------------------------------------------------------------------------------
# stale neighbour lists


def test_collate_refuses_a_stale_list():
    """``collate`` given new positions reuses the stored list: a rigid motion is
    accepted, an atom moved by itself is refused."""
    structure = petfunc.prepare_atoms(ethanol(), CONFIG)
    rotation = np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0]
    moved = structure.positions @ rotation + 5.0
    petfunc.collate([structure], CONFIG, positions=[moved], cells=[structure.cell @ rotation])
    stale = structure.positions.copy()
    stale[0] += [1.5, 0.0, 0.0]
    with pytest.raises(
        ValueError, match=r"structure 0.*not a rigid motion.*stale.*build the structure again"
    ):
        petfunc.collate([structure], CONFIG, positions=[stale])
    crystal = petfunc.prepare_atoms(carbon_cell(), CONFIG)
    with pytest.raises(ValueError, match="structure 0.*a cell row is"):
        petfunc.collate([crystal], CONFIG, cells=[crystal.cell * 1.01])


def test_moved_atoms_rebuild_the_lists(params):
    """The calculator, relaxation and dynamics build the lists again after the atoms
    moved: their energies are those of a fresh calculator at the new positions."""
    atoms = ethanol()
    atoms.calc = PETCalculator(CONFIG, params)
    atoms.get_potential_energy()
    atoms.positions[0] += [2.5, 0.0, 0.0]  # out of some atoms' cutoff, into others'
    fresh = atoms.copy()
    fresh.calc = PETCalculator(CONFIG, params)
    assert atoms.get_potential_energy() == pytest.approx(fresh.get_potential_energy(), rel=1e-12)

    def fresh_energy(structure):
        reference = structure.copy()
        reference.calc = PETCalculator(CONFIG, params)
        return reference.get_potential_energy()

    relaxed = fire(CONFIG, params, [ethanol()], steps=4)
    assert relaxed.energies[0] == pytest.approx(fresh_energy(relaxed.atoms[0]), rel=1e-12)
    moved = run(CONFIG, params, [ethanol()], steps=3, timestep=2.0)
    assert moved.potential_energy[-1, 0] == pytest.approx(fresh_energy(moved.atoms[0]), rel=1e-12)
