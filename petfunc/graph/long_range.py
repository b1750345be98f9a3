"""The integer inputs of PET's long-range features, built eagerly for a batch.

The long-range features (:mod:`petfunc.model.long_range`) sum Coulomb potentials
per structure: over Ewald k-vectors or a P3M mesh for periodic structures, over all
atom pairs for molecules. Which k-vectors, mesh sizes and pairs a structure has
depends on its cell and size, so :func:`build` makes them here, once, as integers
(:class:`LongRange`); everything that depends on positions or the cell is computed
inside the differentiated energy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
import torch

from petfunc.config import PETConfig


METHODS = ("ewald", "p3m")


class LongRange(NamedTuple):
    """Integer inputs of the long-range features of one batch.

    Attributes:
        structure_atoms: ``[n_structures, max_atoms]`` atom id in each slot of a
            structure (0 in padding slots).
        structure_mask: ``[n_structures, max_atoms]`` True for real slots.
        atom_slot: ``[n_atoms]`` flat slot ``s * max_atoms + a`` of each atom.
        periodic: ``[n_structures]`` True for periodic structures (Ewald or P3M),
            False for molecules (direct sum).
        kgrid: ``[n_structures, n_k, 3]`` integer coordinates m of each structure's
            Ewald k-vectors (zero rows pad, at least two rows; the k = 0 term
            vanishes). ``n_k`` is 0 when the batch uses P3M.
        mesh_sizes: ``[n_structures, 3]`` P3M mesh points along each cell vector.
        meshes: P3M batches: per structure, a ``uint8`` tensor of the mesh's shape
            ``[n_a, n_b, n_c]`` (its values are unused; its shape sizes the FFT), or
            None for a molecule. Ewald batches: empty. A :class:`LeadingMeshes`
            covers the first structures only.
        pairs: ``[n_pairs, 2]`` atom pairs (i < j) of every non-periodic structure,
            padded with (0, 0) to at least two.
        pair_mask: ``[n_pairs]`` True for real pairs.
    """

    structure_atoms: torch.Tensor
    structure_mask: torch.Tensor
    atom_slot: torch.Tensor
    periodic: torch.Tensor
    kgrid: torch.Tensor
    mesh_sizes: torch.Tensor
    meshes: tuple[torch.Tensor | None, ...]
    pairs: torch.Tensor
    pair_mask: torch.Tensor

    def to(self, device) -> LongRange:
        fields = [t.to(device) for t in self[:6]]
        meshes = type(self.meshes)(None if m is None else m.to(device) for m in self.meshes)
        return LongRange(*fields, meshes, self.pairs.to(device), self.pair_mask.to(device))


class LeadingMeshes(tuple):
    """P3M meshes of the batch's first ``len(self)`` structures only; every later
    structure is not periodic (direct sum). The layout of an exported model's inputs
    (:mod:`petfunc.export`), whose number of structures is symbolic: a tuple with one
    entry per structure cannot be traced for any batch size."""


def mesh_layout(inputs: LongRange | None) -> tuple[bool, ...] | None:
    """Which structures of a P3M batch have a mesh (None without long-range inputs).

    A traced function is fixed to this layout (its loop over the structures'
    meshes), not to the mesh sizes: compiled calculators keep one graph per layout.
    """
    return None if inputs is None else tuple(m is not None for m in inputs.meshes)


def _frequencies(n: int) -> np.ndarray:
    """Integer FFT frequencies of an ``n``-point axis, in FFT order (0, 1, ..., -1)."""
    m = np.arange(n)
    return np.where(m < (n + 1) // 2, m, m - n)


def ewald_kgrid(cell: np.ndarray, wavelength: float) -> np.ndarray:
    """``[n_k, 3]`` integer grid of torch-pme's Ewald k-vectors for one cell: along each
    cell vector a, ``ceil(|a| / wavelength)`` FFT frequencies (so the grid is a box,
    not a sphere)."""
    ns = np.ceil(np.linalg.norm(cell, axis=1) * (2 * math.pi / wavelength) / 2 / math.pi)
    axes = [_frequencies(int(n)) for n in ns]
    grid = np.stack(np.meshgrid(*axes, indexing="ij"), axis=-1)
    return grid.reshape(-1, 3)


def p3m_mesh_sizes(cell: np.ndarray, spacing: float) -> np.ndarray:
    """``[3]`` torch-pme's P3M mesh: the power of two at or above ``2 |a| / spacing + 1``
    along each cell vector a."""
    approx = 2 * np.linalg.norm(cell, axis=1) / spacing + 1
    return (2 ** np.ceil(np.log2(approx))).astype(np.int64)


def check_periodicity(pbc, label: str) -> None:
    """Raise a ``ValueError`` naming ``label`` unless the structure is periodic along
    all three directions or none.

    metatomic zeroes the cell rows of open directions, so torch-pme's slab correction
    never sees a cell it can use; metatrain fails on these structures too.
    """
    pbc = np.asarray(pbc, dtype=bool).reshape(3)
    if 0 < pbc.sum() < 3:
        raise ValueError(
            f"{label}: long-range features need a structure periodic along all three "
            f"directions or none, got pbc={pbc.tolist()}"
        )


def build(
    config: PETConfig,
    n_atoms: Sequence[int],
    cells: np.ndarray,
    pbcs: np.ndarray,
    method: str = "p3m",
    device=None,
) -> LongRange:
    """The integer long-range inputs of a batch.

    Args:
        config: a model with ``long_range.enable``.
        n_atoms: atoms in each structure, in batch order.
        cells: ``[n_structures, 3, 3]`` lattice vectors as rows (Å).
        pbcs: ``[n_structures, 3]`` periodic directions.
        method: ``"ewald"`` (metatrain's training mode) or ``"p3m"`` (its
            evaluation mode) for the periodic structures.
    Raises:
        ValueError: an unknown method, or a structure periodic along one or two
            directions only (metatrain cannot evaluate those either).
    """
    if method not in METHODS:
        raise ValueError(f"long-range method must be one of {METHODS}, got {method!r}")
    lr = config.long_range
    n_atoms = [int(n) for n in n_atoms]
    n_structures = len(n_atoms)
    cells = np.asarray(cells, dtype=np.float64).reshape(n_structures, 3, 3)
    pbcs = np.asarray(pbcs, dtype=bool).reshape(n_structures, 3)
    for s, pbc in enumerate(pbcs):
        check_periodicity(pbc, f"structure {s}")
    periodic = pbcs.any(axis=1)
    structure_atoms, structure_mask, atom_slot = _atom_layout(n_atoms)
    kgrid = (
        _kgrid(cells, periodic, lr.kspace_resolution)
        if method == "ewald"
        else np.zeros((n_structures, 0, 3), np.int64)
    )
    mesh_sizes = np.ones((n_structures, 3), dtype=np.int64)
    meshes = []  # Ewald batches have none, so their structure is the same for any size
    for s in range(n_structures if method == "p3m" else 0):
        if periodic[s]:
            mesh_sizes[s] = p3m_mesh_sizes(cells[s], lr.kspace_resolution)
            meshes.append(torch.zeros(tuple(int(n) for n in mesh_sizes[s]), dtype=torch.uint8, device=device))
        else:
            meshes.append(None)
    pairs, pair_mask = _molecule_pairs(n_atoms, periodic)

    def t(a, dtype=torch.long):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

    return LongRange(
        structure_atoms=t(structure_atoms),
        structure_mask=t(structure_mask, torch.bool),
        atom_slot=t(atom_slot),
        periodic=t(periodic, torch.bool),
        kgrid=t(kgrid),
        mesh_sizes=t(mesh_sizes),
        meshes=tuple(meshes),
        pairs=t(pairs.reshape(-1, 2)),
        pair_mask=t(pair_mask, torch.bool),
    )


def _atom_layout(n_atoms: list[int]):
    """``(structure_atoms, structure_mask, atom_slot)`` of :class:`LongRange`: each
    structure's atoms in a row of a ``[n_structures, max_atoms]`` grid."""
    offsets = np.cumsum([0] + n_atoms)
    width = max(n_atoms + [2])  # sizes 0 and 1 would be specialised when compiled
    structure_atoms = np.zeros((len(n_atoms), width), dtype=np.int64)
    structure_mask = np.zeros((len(n_atoms), width), dtype=bool)
    atom_slot = np.zeros(offsets[-1], dtype=np.int64)
    for s, n in enumerate(n_atoms):
        atoms = offsets[s] + np.arange(n)
        structure_atoms[s, :n] = atoms
        structure_mask[s, :n] = True
        atom_slot[atoms] = s * width + np.arange(n)
    return structure_atoms, structure_mask, atom_slot


def _kgrid(cells: np.ndarray, periodic: np.ndarray, wavelength: float) -> np.ndarray:
    """``[n_structures, n_k, 3]`` Ewald k-grids of the periodic structures, padded
    with k = 0 (whose term is zero) to the longest, and to at least two rows."""
    grids = [
        ewald_kgrid(cell, wavelength) if p else np.zeros((0, 3), np.int64) for cell, p in zip(cells, periodic)
    ]
    kgrid = np.zeros((len(cells), max([len(g) for g in grids] + [2]), 3), dtype=np.int64)
    for s, g in enumerate(grids):
        kgrid[s, : len(g)] = g
    return kgrid


def _molecule_pairs(n_atoms: list[int], periodic: np.ndarray):
    """``(pairs [n_pairs, 2], mask [n_pairs])``: the atom pairs (i < j, in
    ``torch.combinations`` order) of every non-periodic structure, padded with
    masked ``(0, 0)`` pairs to at least two (compiled graphs specialise sizes 0, 1)."""
    offsets = np.cumsum([0] + n_atoms)
    pairs = []
    for s, n in enumerate(n_atoms):
        if not periodic[s]:
            i, j = np.triu_indices(n, k=1)
            pairs.append(np.stack([i, j], axis=1) + offsets[s])
    pairs = np.concatenate(pairs) if pairs else np.zeros((0, 2), dtype=np.int64)
    n_pad = max(0, 2 - len(pairs))
    mask = np.concatenate([np.ones(len(pairs), dtype=bool), np.zeros(n_pad, dtype=bool)])
    return np.concatenate([pairs, np.zeros((n_pad, 2), dtype=np.int64)]), mask
