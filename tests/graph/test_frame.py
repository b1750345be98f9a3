"""The model's frame (petfunc.graph.frame): structures moved close to the origin with
their edge vectors unchanged, and the rigid-motion check of a reused list."""

import ase
import ase.build
import numpy as np
import pytest

import petfunc
from petfunc.graph import check_rigid_motion, edge_list, model_frame
from tests.helpers.samples import slab


CUTOFF = 3.0


def _vectors(positions, cell, centers, neighbors, shifts):
    return positions[neighbors] - positions[centers] + shifts @ cell


def _molecule():
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.positions += [1e6, -3e5, 2e5]
    return atoms


def _slab():
    """pbc (T, T, F), 1e6 Å above the origin and 1e4 cells away in-plane."""
    atoms = slab()
    atoms.positions += np.array([1e4, -1e4, 0]) @ atoms.cell.array + [0, 0, 1e6]
    return atoms


def _wire():
    atoms = ase.Atoms("CH", positions=[[0, 0, 0], [0.5, 1.0, 0.3]], cell=[[1.9, 0, 0], [0, 0, 0], [0, 0, 0]])
    atoms.pbc = [True, False, False]
    atoms.positions += [-1.9e4, 5e5, 5e5]
    return atoms


def _diffused():
    """A crystal whose atoms each moved by their own number of cells."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.rattle(0.05, seed=2)
    moves = np.random.default_rng(0).integers(-10_000, 10_000, size=(len(atoms), 3))
    atoms.positions += moves @ atoms.cell.array
    return atoms


@pytest.mark.parametrize("make", [_molecule, _slab, _wire, _diffused])
def test_edge_vectors_unchanged_and_coordinates_small(make):
    atoms = make()
    positions, cell, pbc = atoms.positions, np.asarray(atoms.cell), atoms.pbc
    i, j, s = edge_list(positions, cell, pbc, CUTOFF)
    assert len(i) > 0
    moved, shifts = model_frame(positions, cell, pbc, i, j, s)
    np.testing.assert_allclose(
        _vectors(moved, cell, i, j, shifts), _vectors(positions, cell, i, j, s), rtol=0, atol=1e-9
    )
    # within a few cells of the origin (the molecule: its own size)
    assert np.abs(moved).max() < 3 * max(np.abs(cell).sum(axis=0).max(), 1.0) + 3.0
    assert shifts.dtype == np.int64


def test_crystal_near_its_cell_is_left_alone():
    """Atoms just outside their cell (rattled) keep their positions and cell shifts
    bit for bit: float64 results of ordinary structures do not change."""
    atoms = ase.build.bulk("C", "diamond", a=3.57)
    atoms.rattle(0.05, seed=2)
    assert atoms.get_scaled_positions(wrap=False).min() < 0
    positions, cell = atoms.positions, np.asarray(atoms.cell)
    i, j, s = edge_list(positions, cell, atoms.pbc, CUTOFF)
    moved, shifts = model_frame(positions, cell, atoms.pbc, i, j, s)
    assert np.array_equal(moved, positions) and np.array_equal(shifts, s)


def test_molecule_is_centred():
    atoms = _molecule()
    moved, _ = model_frame(atoms.positions, np.zeros((3, 3)), [False] * 3, [], [], np.zeros((0, 3)))
    np.testing.assert_allclose(moved.mean(axis=0), 0.0, atol=1e-9)
    np.testing.assert_allclose(moved + atoms.positions.mean(axis=0), atoms.positions, rtol=0, atol=1e-9)


def test_rigid_motions_accepted():
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.rattle(0.05, seed=2)
    positions, cell = atoms.positions, np.asarray(atoms.cell)
    rotation = np.linalg.qr(np.random.default_rng(1).normal(size=(3, 3)))[0]
    for r in (rotation, -rotation):  # proper and improper
        check_rigid_motion(positions, positions @ r + 7.0, cell, cell @ r, atoms.pbc)
    # one atom: the cell fixes the rotation
    check_rigid_motion(positions[:1], positions[:1] @ rotation, cell, cell @ rotation, atoms.pbc)


def test_other_motions_refused():
    atoms = ase.build.molecule("CH3CH2OH")
    positions = atoms.positions
    moved = positions.copy()
    moved[2] += 1e-5
    with pytest.raises(
        ValueError, match=r"ethanol: .*not a rigid motion.*an atom is [0-9.e-]+ Å away.*prepare"
    ):
        check_rigid_motion(positions, moved, np.zeros((3, 3)), np.zeros((3, 3)), [False] * 3, "ethanol")
    with pytest.raises(ValueError, match=r"shape \(8, 3\) replace ones of shape \(9, 3\)"):
        check_rigid_motion(positions, positions[:-1], np.zeros((3, 3)), np.zeros((3, 3)), [False] * 3)
    crystal = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    cell = np.asarray(crystal.cell)
    # rotating the atoms inside a fixed cell changes the periodic images
    tilted = np.linalg.qr(np.random.default_rng(2).normal(size=(3, 3)))[0]
    with pytest.raises(ValueError, match="not a rigid motion"):
        check_rigid_motion(crystal.positions, crystal.positions @ tilted, cell, cell, True)


def test_public():
    assert petfunc.graph.model_frame is model_frame
