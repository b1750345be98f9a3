"""The neighbour graph: pairs against ASE, the NEF layout, the reverse index, bad input."""

import ase
import ase.build
import ase.neighborlist
import numpy as np
import pytest
import torch

import petfunc


CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2
)


def _structures():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    small = ase.build.bulk("C", "diamond", a=3.57)  # vectors of 2.5 A: many images
    small.rattle(0.05, seed=2)
    rng = np.random.default_rng(3)
    triclinic = ase.Atoms(
        "CNOH",
        scaled_positions=rng.random((4, 3)),
        cell=[[3.1, 0.0, 0.0], [1.2, 2.9, 0.0], [-0.7, 0.5, 3.3]],
        pbc=True,
    )
    slab = ase.Atoms(
        "CCOH",
        positions=[[0, 0, 0], [1.3, 1.2, 0.1], [0.1, 1.4, 1.3], [1.5, 0.2, 2.4]],
        cell=[[2.6, 0, 0], [0.4, 2.7, 0], [0, 0, 0]],
        pbc=[True, True, False],
    )
    wire = ase.Atoms(
        "CH",
        positions=[[0, 0, 0], [0.5, 1.0, 0.3]],
        cell=[[1.9, 0, 0], [0, 0, 0], [0, 0, 0]],
        pbc=[True, False, False],
    )
    return {"ethanol": ethanol, "small_cell": small, "triclinic": triclinic, "slab": slab, "wire": wire}


STRUCTURES = _structures()


def _edge_set(i, j, shifts):
    return sorted(
        zip(np.asarray(i).tolist(), np.asarray(j).tolist(), map(tuple, np.asarray(shifts).tolist()))
    )


@pytest.mark.parametrize("name", list(STRUCTURES))
@pytest.mark.parametrize("cutoff", [3.0, 4.5])
def test_pairs_equal_ase(name, cutoff):
    atoms = STRUCTURES[name]
    config = petfunc.PETConfig(**{**CONFIG.to_hypers(), "cutoff": cutoff})
    structure = petfunc.prepare_atoms(atoms, config)
    i, j, s = ase.neighborlist.neighbor_list("ijS", atoms, cutoff)
    assert _edge_set(structure.centers, structure.neighbors, structure.shifts) == _edge_set(i, j, s)
    # ... and the NEF grid holds exactly those pairs, once each
    _, _, graph = petfunc.from_atoms(atoms, config, dtype=torch.float64)
    nef = graph.kept_edges[graph.nef_index[graph.nef_mask]]
    assert len(nef) == len(i) and len(set(nef.tolist())) == len(nef)
    assert _edge_set(graph.centers[nef], graph.neighbors[nef], graph.cell_shifts[nef]) == _edge_set(i, j, s)
    if name == "small_cell":  # periodic images of an atom itself are edges
        assert any(a == b for a, b, _ in _edge_set(i, j, s))


def _check_layout(graph, positions, cell):
    n_atoms, width = graph.nef_index.shape
    mask = graph.nef_mask
    kept = graph.kept_edges
    n_kept = len(kept)
    centers = graph.centers[kept]
    # tokens are in NEF order: sorted by centre, list order within a centre
    assert torch.all(centers[1:] >= centers[:-1])
    for atom in range(n_atoms):
        ids = kept[centers == atom]
        assert torch.all(ids[1:] > ids[:-1])
    counts = torch.bincount(centers, minlength=n_atoms)
    assert torch.equal(mask.sum(1), counts)
    # rows are left-aligned: real slots first
    assert torch.equal(mask, torch.arange(width)[None, :] < counts[:, None])
    # real slots hold the tokens in order; nef_slot is the inverse map
    assert torch.equal(graph.nef_index[mask], torch.arange(n_kept))
    assert torch.equal(graph.nef_slot, torch.nonzero(mask.reshape(-1)).reshape(-1))
    # padded slots point at tokens 0, 1, 2, ... (spread out, masked by the model)
    assert torch.equal(graph.nef_index[~mask], torch.arange(int((~mask).sum())) % max(n_kept, 1))

    rev = graph.reverse_index
    tokens = torch.arange(n_kept)
    # an involution on the tokens
    assert torch.equal(rev[rev], tokens)
    # the reverse token is (j, i, -S), whose vector is exactly -r
    e, e_rev = kept, kept[rev]
    assert torch.equal(graph.centers[e], graph.neighbors[e_rev])
    assert torch.equal(graph.neighbors[e], graph.centers[e_rev])
    assert torch.equal(graph.cell_shifts[e], -graph.cell_shifts[e_rev])
    vectors = petfunc.model.edge_vectors(positions, cell, graph)
    assert torch.equal(vectors[e], -vectors[e_rev])


@pytest.mark.parametrize("name", list(STRUCTURES))
def test_nef_layout_and_reverse_index(name):
    positions, cell, graph = petfunc.from_atoms(STRUCTURES[name], CONFIG, dtype=torch.float64)
    _check_layout(graph, positions, cell)


def test_batch_layout_and_offsets():
    frames = list(STRUCTURES.values())
    positions, cell, graph = petfunc.from_atoms(frames, CONFIG, dtype=torch.float64)
    _check_layout(graph, positions, cell)
    assert torch.equal(
        graph.structure_index,
        torch.repeat_interleave(torch.arange(len(frames)), torch.tensor([len(a) for a in frames])),
    )
    offset = 0
    for s, atoms in enumerate(frames):
        one = petfunc.prepare_atoms(atoms, CONFIG)
        inside = (graph.centers >= offset) & (graph.centers < offset + len(atoms))
        assert torch.equal(graph.centers[inside] - offset, torch.as_tensor(one.centers))
        assert torch.equal(graph.neighbors[inside] - offset, torch.as_tensor(one.neighbors))
        assert (graph.structure_index[graph.centers[inside]] == s).all()
        offset += len(atoms)


def test_adaptive_grid_holds_a_subset():
    config = petfunc.PETConfig(**{**CONFIG.to_hypers(), "num_neighbors_adaptive": 6})
    atoms = STRUCTURES["small_cell"]
    positions, cell, graph = petfunc.from_atoms(atoms, config, dtype=torch.float64)
    i, _, _ = ase.neighborlist.neighbor_list("ijS", atoms, config.cutoff)
    assert len(graph.centers) == len(i)  # the full list, for counting neighbours
    assert graph.nef_mask.sum() < len(i)  # the grid: only the edges inside r_ij
    _check_layout(graph, positions, cell)


def test_isolated_atom_graph():
    _, _, graph = petfunc.from_atoms(ase.Atoms("H"), CONFIG)
    assert graph.nef_index.shape == (1, 0)
    assert len(graph.centers) == 0 and len(graph.reverse_index) == 0


# ---------------------------------------------------------------------------------------
# bad input


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
    ~1000 Å at angles of ~1e-5 rad: the same edges, up to the shifts (the volume was
    compared with the largest vector cubed, and this cell was called singular)."""
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
        match=r"atoms (0 and 1|1 and 0) are at the same place \(atom [01] through the periodic image shifted by \[-?1, 0, 0\] cells\)",
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
    # the unused rows may even be infinite (they were refused); a periodic one may not
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
    """A cell thin enough to give each atom ~1e5 neighbours passed the singularity
    check and then failed allocating hundreds of GB; it is an error naming it."""
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


def test_asymmetric_list_is_rejected():
    centers, neighbors, shifts = np.array([0, 1]), np.array([1, 0]), np.array([[0, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="not symmetric"):
        petfunc.graph.neighbors.reverse_edges(centers, neighbors, shifts)
