"""The checks that refuse a structure before its graph is built (petfunc.graph.checks):
unknown species, non-finite positions, singular and almost singular cells,
coinciding atoms, mismatched shapes, empty structures and batches; what they let
pass (very skewed cells of the same lattice, zero rows along open directions)."""

import ase
import ase.build
import numpy as np
import pytest

import petfunc


CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2
)


def test_unknown_species():
    atoms = ase.Atoms("CU", positions=[[0, 0, 0], [1.5, 0, 0]])
    with pytest.raises(
        ValueError, match=r"structure 0: atomic number\(s\) \[92\] are not among .*\(1, 6, 7, 8\)"
    ):
        petfunc.from_atoms(atoms, CONFIG)
    # a type below max(atomic_types) that is not listed fails the same way
    with pytest.raises(ValueError, match=r"\[2\]"):
        petfunc.from_atoms([ase.Atoms("H"), ase.Atoms("He")], CONFIG)
    with pytest.raises(ValueError, match="structure 1"):
        petfunc.from_atoms([ase.Atoms("H"), ase.Atoms("He")], CONFIG)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_non_finite_positions(bad):
    atoms = ase.Atoms("CH", positions=[[0, 0, 0], [bad, 0, 0]])
    with pytest.raises(ValueError, match="positions contain NaN or infinite values"):
        petfunc.from_atoms(atoms, CONFIG)


@pytest.mark.parametrize(
    "cell", [[[2, 0, 0], [4, 0, 0], [0, 0, 3]], [[2, 0, 0], [0, 0, 0], [0, 0, 3]], np.zeros((3, 3))]
)
def test_singular_periodic_cell(cell):
    atoms = ase.Atoms("CH", positions=[[0, 0, 0], [1, 0, 0]], cell=cell, pbc=True)
    with pytest.raises(ValueError, match="cell is singular along its periodic directions"):
        petfunc.from_atoms(atoms, CONFIG)


def test_very_skewed_cell_is_the_same_lattice():
    """A unimodular change of basis gives the same crystal in a cell with vectors of
    ~1000 Å at angles of ~1e-5 rad: the same edges, up to the shifts (a comparison of
    the volume with the largest vector cubed would call this cell singular)."""
    atoms = ase.build.bulk("C", "diamond", a=3.6)
    atoms.rattle(0.05, seed=1)
    change = np.array([[1, 20, 0], [0, 1, 0], [0, -20, 1]]) @ np.array([[1, 0, 0], [20, 1, 0], [0, 0, 1]])
    skewed = atoms.copy()
    skewed.set_cell(change @ atoms.cell, scale_atoms=False)
    assert skewed.cell.volume / np.abs(skewed.cell).max() ** 3 < 1e-6
    plain = petfunc.prepare(atoms.numbers, atoms.positions, atoms.cell, True, CONFIG)
    other = petfunc.prepare(skewed.numbers, skewed.positions, skewed.cell, True, CONFIG)

    def vectors(s):
        d = s.positions[s.neighbors] - s.positions[s.centers] + s.shifts @ s.cell
        return np.sort(np.round(np.column_stack([s.centers, s.neighbors, d]), 8), axis=0)

    assert len(plain.centers) == len(other.centers) > 50
    np.testing.assert_allclose(vectors(other), vectors(plain), atol=1e-8)
    # degenerate up to round-off is still singular
    rows = np.array([[2.0, 0.3, 0.1], [0.0, 3.0, 0.2], [0.0, 0.0, 0.0]])
    rows[2] = rows[0] / 3 + rows[1] * 0.7
    with pytest.raises(ValueError, match="cell is singular along its periodic directions"):
        petfunc.prepare([6], [[0, 0, 0]], rows, True, CONFIG)


def test_coinciding_atoms():
    """Atoms at one place (or on a periodic image of another) have no PET energy
    (and an infinite ZBL one); metatrain returns a meaningless finite number, or
    inf with ZBL. Here a clear error; 1e-6 Å apart is still evaluated."""
    atoms = ase.Atoms("COH", positions=[[0, 0, 0], [0, 0, 0], [1.0, 0.3, 0]])
    with pytest.raises(
        ValueError, match=r"structure 1: atoms 0 and 1 are at the same place; PET has no energy"
    ):
        petfunc.from_atoms([ase.Atoms("H"), atoms], CONFIG)
    image = ase.Atoms("CO", positions=[[0, 0, 0], [3.0, 0, 0]], cell=[3, 3, 3], pbc=True)
    with pytest.raises(
        ValueError,
        match=r"atoms (0 and 1|1 and 0) are at the same place "
        r"\(atom [01] through the periodic image shifted by \[-?1, 0, 0\] cells\)",
    ):
        petfunc.from_atoms(image, CONFIG)
    atoms.positions[1, 0] = 1e-6
    petfunc.from_atoms(atoms, CONFIG)


def test_zero_cell_rows_are_fine_when_not_periodic():
    atoms = ase.Atoms(
        "CH",
        positions=[[0, 0, 0], [1, 0, 0]],
        cell=[[2, 0, 0], [0, 0, 0], [0, 0, 0]],
        pbc=[True, False, False],
    )
    reference = petfunc.prepare([6, 1], atoms.positions, atoms.cell, atoms.pbc, CONFIG)
    # the unused rows may even be infinite; a periodic one may not
    cell = np.array([[2, 0, 0], [np.inf, 0, 0], [0, np.nan, 0]])
    structure = petfunc.prepare([6, 1], atoms.positions, cell, [True, False, False], CONFIG)
    assert np.array_equal(structure.cell, reference.cell) and np.array_equal(
        structure.shifts, reference.shifts
    )
    with pytest.raises(
        ValueError, match="cell contains NaN or infinite values along its periodic directions"
    ):
        petfunc.prepare([6, 1], atoms.positions, cell, [True, True, False], CONFIG)


@pytest.mark.parametrize("pbc", [[True, True, True], [True, True, False], [True, False, False]])
def test_almost_singular_cell(pbc):
    """A cell thin enough to give each atom ~1e5 neighbours passes the singularity
    check, and its graph would take hundreds of GB: it is an error naming it."""
    thin = np.diag([3.0, 3.0, 3.0])
    thin[np.flatnonzero(pbc)[-1]] *= 1e-4
    with pytest.raises(
        ValueError,
        match=r"structure: 2 atom\(s\) in a cell of a (periodic length|periodic area|volume) of "
        r".* would give each atom about .* neighbours within the 4.5 Å cutoff; "
        r"the cell is almost singular or not in Å",
    ):
        petfunc.prepare([6, 1], [[0, 0, 0], [1, 1, 1]], thin, pbc, CONFIG)
    # cells smaller than the cutoff are fine: 1 atom in a 1.2 Å cube has ~200 neighbours
    small = petfunc.prepare([6], [[0, 0, 0]], np.diag([1.2, 1.2, 1.2]), True, CONFIG)
    assert len(small.centers) > 100
    # a cell in nm read as Å: 64 atoms in a 0.9 "Å" cube
    with pytest.raises(ValueError, match=r"64 atom\(s\) in a cell of a volume of 0.729 Å\^3"):
        petfunc.prepare(
            [6] * 64, np.random.default_rng(0).random((64, 3)) * 0.9, np.diag([0.9] * 3), True, CONFIG
        )


def test_mismatched_shapes():
    with pytest.raises(ValueError, match="3 atomic numbers but 2 positions"):
        petfunc.prepare([6, 1, 1], [[0, 0, 0], [1, 0, 0]], None, False, CONFIG)
    with pytest.raises(ValueError, match=r"positions must have shape \[n_atoms, 3\], got \(2, 2\)"):
        petfunc.prepare([6, 1], [[0, 0], [1, 0]], None, False, CONFIG)
    with pytest.raises(ValueError, match=r"cell must have shape \[3, 3\]"):
        petfunc.graph.check_structure(np.zeros((2, 3)), np.eye(2), [True] * 3)


def test_empty_structure_and_empty_batch():
    with pytest.raises(ValueError, match="structure 0: has no atoms"):
        petfunc.from_atoms(ase.Atoms(), CONFIG)
    with pytest.raises(ValueError, match="zero structures"):
        petfunc.from_atoms([], CONFIG)
