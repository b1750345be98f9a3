"""The neighbour graph: integer data built eagerly, outside any traced code.

Conventions (as in ASE and metatrain):

* ``cell`` is ``[n_structures, 3, 3]`` and its **rows** are the lattice vectors; rows
  of non-periodic directions are zero, so a molecule has an all-zero cell.
* an edge ``e = (i, j, S)`` (``centers[e] = i``, ``neighbors[e] = j``, integer
  ``cell_shifts[e] = S``) has the vector ``r_e = positions[j] - positions[i] + S @ cell``.
* the list is *full*: both ``(i, j, S)`` and ``(j, i, -S)`` are present.

PET does not use the flat edge list directly. Its tokens are the *kept* edges
(``kept_edges``: ``d <= cutoff`` or, adaptive, ``d <= (r_i + r_j) / 2``), listed by
centre atom and, within one centre, in list order (metatrain's NEF order). Every
per-token layer (embeddings, MLPs, norms, projections, heads) runs on this list of
``n_kept`` tokens only. Attention alone needs each atom's tokens side by side: it
uses the NEF (node, edge, feature) grid ``[n_atoms, max_neighbors]``, where
``nef_index[i, k]`` is the token in slot ``k`` of atom ``i``, ``nef_mask`` says which
slots are real and ``nef_slot[t] = i * max_neighbors + k`` maps each token back to
its slot. ``reverse_index[t]`` is the token of the reversed edge ``j -> i``.
Padded slots point at tokens 0, 1, 2, ... (spread out, so the backward of the
gather has no hot spot); the model masks them to zero.

The flat list may hold more edges than PET uses (the adaptive cutoff counts every
edge within ``cutoff``, ZBL may need a longer list).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from vesin import NeighborList


class Neighbors(NamedTuple):
    """Integer description of a batch of structures (no floats, no gradients).

    It is valid for the positions and cells it was built for, and only for them: the
    flat list has no skin (it holds exactly the pairs within the cutoff), and which
    edges PET keeps, its NEF grid and, for adaptive cutoffs, the pair radii are
    chosen at those positions. The energy function trusts it and does not check: a
    list reused after atoms moved gives a wrong energy without an error. Build it
    again (:func:`petfunc.from_atoms`, :func:`petfunc.collate`) whenever

    * any atom moves, by any distance, other than in a rigid motion (rotation,
      reflection, translation) of a whole structure together with its cell;
    * a cell changes (a strain, or a change of ``pbc``);
    * atoms are added, removed or reordered, or a species, charge or spin
      multiplicity changes.

    petfunc's calculators, relaxations and dynamics build it again at every step.
    A flat list built with a skin (:func:`edge_list` for ``cutoff + skin``) stays
    complete until some atom has moved by more than ``skin / 2`` since it was built
    (as ASE's lists do), but the kept edges and NEF grid of a ``Neighbors`` must
    still be chosen again at the new positions. :func:`petfunc.collate` given new
    ``positions`` refuses any that are not a rigid motion of the stored ones.

    Attributes:
        species: ``[n_atoms]`` species index of each atom (position of its atomic
            number in ``config.atomic_types``).
        structure_index: ``[n_atoms]`` which structure each atom belongs to.
        centers: ``[n_edges]`` atom i of each edge.
        neighbors: ``[n_edges]`` atom j of each edge.
        cell_shifts: ``[n_edges, 3]`` integer lattice shift S of each edge.
        kept_edges: ``[n_kept]`` ids (into the flat list) of the edges PET uses: its
            edge tokens, in NEF order.
        nef_index: ``[n_atoms, max_neighbors]`` token in each NEF slot.
        nef_mask: ``[n_atoms, max_neighbors]`` True for real slots.
        nef_slot: ``[n_kept]`` flat NEF slot ``i * max_neighbors + k`` of each token.
        reverse_index: ``[n_kept]`` token of the reversed edge.
        charge: ``[n_structures]`` total charge of each structure (elementary
            charges; 0 unless given). Read only by models with
            ``system_conditioning``.
        spin_multiplicity: ``[n_structures]`` spin multiplicity 2S+1 of each
            structure (1 unless given). Read only by models with
            ``system_conditioning``.
        long_range: the integer inputs of the long-range features
            (:class:`petfunc.graph.LongRange`), or None for models without them.
    """

    species: torch.Tensor
    structure_index: torch.Tensor
    centers: torch.Tensor
    neighbors: torch.Tensor
    cell_shifts: torch.Tensor
    kept_edges: torch.Tensor
    nef_index: torch.Tensor
    nef_mask: torch.Tensor
    nef_slot: torch.Tensor
    reverse_index: torch.Tensor
    charge: torch.Tensor
    spin_multiplicity: torch.Tensor
    long_range: Any | None = None

    @property
    def n_atoms(self) -> int:
        return self.species.shape[0]

    @property
    def max_neighbors(self) -> int:
        return self.nef_index.shape[1]

    def to(self, device) -> Neighbors:
        return Neighbors(*(None if t is None else t.to(device) for t in self))


# ---------------------------------------------------------------------------------------
# flat edge lists


def species_index(numbers, atomic_types: Sequence[int]) -> np.ndarray:
    """Map atomic numbers to species indices; unknown species raise ``ValueError``."""
    numbers = np.asarray(numbers, dtype=np.int64)
    lookup = {int(z): i for i, z in enumerate(atomic_types)}
    unknown = sorted({int(z) for z in np.unique(numbers)} - set(lookup))
    if unknown:
        raise ValueError(
            f"atomic number(s) {unknown} are not among the model's atomic_types {tuple(atomic_types)}"
        )
    return np.array([lookup[int(z)] for z in numbers], dtype=np.int64)


def edge_list(positions, cell, pbc, cutoff: float):
    """Full neighbour list of one structure with vesin: (centers, neighbors, shifts).

    Pairs are within ``cutoff`` (strict); periodic images of an atom itself are
    included, the zero-shift self pair is not. ``cell`` rows for non-periodic
    directions are ignored.
    """
    positions = np.ascontiguousarray(positions, dtype=np.float64)
    pbc = np.asarray(pbc, dtype=bool).reshape(3)
    box = np.array(cell, dtype=np.float64).reshape(3, 3)
    box[~pbc] = 0.0
    if not pbc.any():
        box = np.zeros((3, 3))
    if len(positions) == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, np.zeros((0, 3), dtype=np.int64)
    calculator = NeighborList(cutoff=float(cutoff), full_list=True)
    i, j, shifts = calculator.compute(
        positions, box, pbc.tolist() if pbc.any() and not pbc.all() else bool(pbc.all()), quantities="ijS"
    )
    return i.astype(np.int64), j.astype(np.int64), shifts.astype(np.int64).reshape(-1, 3)


# ---------------------------------------------------------------------------------------
# NEF layout


def reverse_edges(centers: np.ndarray, neighbors: np.ndarray, shifts: np.ndarray) -> np.ndarray:
    """For each edge (i, j, S) the id of the edge (j, i, -S); raises if one is missing."""
    n = len(centers)
    if n == 0:
        return np.zeros(0, dtype=np.int64)
    forward = np.column_stack([centers, neighbors, shifts])
    backward = np.column_stack([neighbors, centers, -shifts])
    order_f = np.lexsort(forward.T[::-1])
    order_b = np.lexsort(backward.T[::-1])
    if not np.array_equal(forward[order_f], backward[order_b]):
        raise ValueError(
            "the neighbour list is not symmetric: some edge (i, j, S) has no reverse "
            "edge (j, i, -S); PET needs a full neighbour list"
        )
    reverse = np.empty(n, dtype=np.int64)
    reverse[order_b] = order_f
    return reverse


def nef_layout(
    centers: np.ndarray, neighbors: np.ndarray, shifts: np.ndarray, kept: np.ndarray, n_atoms: int
):
    """Tokens and NEF grid of the kept edges, as numpy arrays.

    Args:
        centers, neighbors, shifts: the flat edge list ``[n_edges]``, ``[n_edges, 3]``.
        kept: ``[n_kept]`` ids of the edges PET uses, in list order. It must be closed
            under reversal.
        n_atoms: number of atoms in the batch.
    Returns:
        ``(kept_edges, nef_index, nef_mask, nef_slot, reverse_index)``, see
        :class:`Neighbors`.
    """
    kept = np.asarray(kept, dtype=np.int64)
    order = np.argsort(centers[kept], kind="stable")
    kept = kept[order]  # NEF order: by centre, then list order
    c = centers[kept]
    n_kept = len(kept)
    counts = np.bincount(c, minlength=n_atoms) if n_kept else np.zeros(n_atoms, dtype=np.int64)
    width = int(counts.max()) if n_atoms > 0 and n_kept else 0
    starts = np.cumsum(counts) - counts
    slot = np.arange(n_kept, dtype=np.int64) - starts[c]

    nef_mask = np.zeros((n_atoms, width), dtype=bool)
    nef_mask[c, slot] = True
    nef_index = np.empty((n_atoms, width), dtype=np.int64)
    nef_index[c, slot] = np.arange(n_kept, dtype=np.int64)
    n_pad = n_atoms * width - n_kept
    nef_index[~nef_mask] = np.arange(n_pad, dtype=np.int64) % max(n_kept, 1)
    nef_slot = c * width + slot

    reverse_index = reverse_edges(c, neighbors[kept], shifts[kept])
    return kept, nef_index, nef_mask, nef_slot, reverse_index


def build(
    species: np.ndarray,
    structure_index: np.ndarray,
    centers: np.ndarray,
    neighbors: np.ndarray,
    shifts: np.ndarray,
    kept: np.ndarray | None = None,
    device=None,
    charge: np.ndarray | None = None,
    spin_multiplicity: np.ndarray | None = None,
    long_range=None,
) -> Neighbors:
    """Assemble :class:`Neighbors` from batch-level (already offset) numpy arrays.

    ``charge`` and ``spin_multiplicity`` are per structure (default 0 and 1);
    ``long_range`` is a ready :class:`petfunc.graph.LongRange` (or None).
    """
    n_atoms = len(species)
    n_structures = int(np.max(structure_index)) + 1 if n_atoms else 0
    if charge is None:
        charge = np.zeros(n_structures, dtype=np.int64)
    if spin_multiplicity is None:
        spin_multiplicity = np.ones(n_structures, dtype=np.int64)
    if len(charge) != n_structures or len(spin_multiplicity) != n_structures:
        raise ValueError(
            f"{n_structures} structures but {len(charge)} charges and "
            f"{len(spin_multiplicity)} spin multiplicities"
        )
    if kept is None:
        kept = np.arange(len(centers), dtype=np.int64)
    kept, nef_index, nef_mask, nef_slot, reverse_index = nef_layout(centers, neighbors, shifts, kept, n_atoms)

    def t(a, dtype=torch.long):
        return torch.as_tensor(np.ascontiguousarray(a), dtype=dtype, device=device)

    return Neighbors(
        species=t(species),
        structure_index=t(structure_index),
        centers=t(centers),
        neighbors=t(neighbors),
        cell_shifts=t(np.asarray(shifts).reshape(-1, 3)),
        kept_edges=t(kept),
        nef_index=t(nef_index),
        nef_mask=t(nef_mask, torch.bool),
        nef_slot=t(nef_slot),
        reverse_index=t(reverse_index),
        charge=t(charge),
        spin_multiplicity=t(spin_multiplicity),
        long_range=long_range,
    )
