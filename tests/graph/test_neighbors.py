"""The neighbour graph: pairs against ASE, the NEF layout, the reverse index, an
asymmetric list refused."""

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


def test_asymmetric_list_is_rejected():
    centers, neighbors, shifts = np.array([0, 1]), np.array([1, 0]), np.array([[0, 0, 0], [0, 0, 1]])
    with pytest.raises(ValueError, match="not symmetric"):
        petfunc.graph.neighbors.reverse_edges(centers, neighbors, shifts)
