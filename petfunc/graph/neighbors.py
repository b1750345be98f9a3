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


class Neighbors(NamedTuple):
    """Integer description of a batch of structures (no floats, no gradients).

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
            (:class:`petfunc.model.long_range.LongRange`), or None for models without them.
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


def check_sizes(positions, cell, neighbors: Neighbors) -> None:
    """Raise ``ValueError`` when ``positions [n_atoms, 3]`` or ``cell [n_structures, 3,
    3]`` do not fit ``neighbors``: torch would fail deep inside the network, or not
    at all (an extra row of positions gave forces with a zero row, an extra cell a
    phantom structure). Sizes of traced tensors are symbolic and are not compared
    (that would add guards to the trace); the real tensors are checked before."""
    if positions.dim() != 2:
        raise ValueError(f"positions must be [n_atoms, 3], got {list(positions.shape)}")
    if cell.dim() != 3:
        raise ValueError(
            f"cell must be [n_structures, 3, 3] (one cell per structure), got {list(cell.shape)}"
        )
    sizes = (positions.shape[0], neighbors.species.shape[0], cell.shape[0], neighbors.charge.shape[0])
    if all(type(size) is int for size in sizes + tuple(positions.shape) + tuple(cell.shape)):
        if positions.shape[1] != 3:
            raise ValueError(f"positions must be [n_atoms, 3], got {list(positions.shape)}")
        if tuple(cell.shape[1:]) != (3, 3):
            raise ValueError(
                f"cell must be [n_structures, 3, 3] (one cell per structure), got {list(cell.shape)}"
            )
        if sizes[0] != sizes[1]:
            raise ValueError(f"positions has {sizes[0]} rows, but the neighbour list is for {sizes[1]} atoms")
        if sizes[2] != sizes[3]:
            raise ValueError(
                f"cell has {sizes[2]} cells, but the neighbour list is for {sizes[3]} structures"
            )


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


def check_structure(positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, label: str = "structure"):
    """Raise a clear ``ValueError`` on NaN/inf positions or a singular periodic cell."""
    positions = np.asarray(positions, dtype=np.float64)
    if positions.ndim != 2 or positions.shape[1] != 3:
        raise ValueError(f"{label}: positions must have shape [n_atoms, 3], got {positions.shape}")
    if not np.all(np.isfinite(positions)):
        raise ValueError(f"{label}: positions contain NaN or infinite values")
    cell = np.asarray(cell, dtype=np.float64)
    if cell.shape != (3, 3):
        raise ValueError(f"{label}: cell must have shape [3, 3], got {cell.shape}")
    pbc = np.asarray(pbc, dtype=bool).reshape(-1)
    if pbc.shape != (3,):
        raise ValueError(f"{label}: pbc must have 3 entries, got {pbc.shape}")
    # the rows of non-periodic directions are not used (prepare sets them to zero)
    if not np.all(np.isfinite(cell[pbc])):
        raise ValueError(f"{label}: the cell contains NaN or infinite values along its periodic directions")
    if pbc.any():
        periodic_rows = cell[pbc]
        # volume (length, area) of the periodic lattice vectors over the product of
        # their lengths, the sine of their angles: round-off (1e-16) when they are
        # degenerate. QR gives it to that accuracy; a Gram determinant would lose half
        # the digits and refuse very skewed but valid cells.
        lengths = np.linalg.norm(periodic_rows, axis=1)
        sine = 0.0
        if np.all(lengths > 0.0):
            r = np.linalg.qr(periodic_rows.T, mode="r")
            sine = float(np.abs(np.prod(np.diag(r))) / np.prod(lengths))
        if not sine > 1e-10:
            raise ValueError(
                f"{label}: the cell is singular along its periodic directions "
                f"(pbc={pbc.tolist()}, cell={cell.tolist()})"
            )


def wrapped(positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray) -> np.ndarray:
    """``positions [n, 3]`` moved by whole vectors of the periodic rows of ``cell``
    into the cell (fractional coordinates in [0, 1) along ``pbc``, up to round-off);
    the other coordinates are kept. The rows of non-periodic directions are ignored."""
    positions = np.asarray(positions, dtype=np.float64)
    periodic = np.asarray(cell, dtype=np.float64)[pbc]
    # fractional coordinates along the periodic rows: least squares solves them in
    # the rows' span, whatever the non-periodic components are
    frac = np.linalg.lstsq(periodic.T, positions.T, rcond=None)[0].T
    return positions - np.floor(frac) @ periodic


# More neighbours per atom than this cannot be a physical structure (solids hold at
# most ~0.2 atoms/Å^3: ~1,500 neighbours within 12 Å); it is a cell in the wrong
# units or an almost singular one, whose neighbour list would exhaust the memory.
MAX_NEIGHBORS_ESTIMATE = 1e4


def check_density(
    positions: np.ndarray, cell: np.ndarray, pbc: np.ndarray, cutoff: float, label: str = "structure"
) -> None:
    """Raise a ``ValueError`` before building the neighbour list when an atom would
    have more than :data:`MAX_NEIGHBORS_ESTIMATE` neighbours within ``cutoff`` (Å).

    Two estimates: the periodic images of one atom, ``b_k(cutoff) / m`` with ``m``
    the periodic length, area or volume and ``b_k`` the k-ball (``2 r``, ``pi r^2``,
    ``4/3 pi r^3``): large for an almost singular cell, whatever the atoms; and,
    periodic in 3 directions, ``n_atoms * b_3(cutoff) / V``: large for a cell too
    small for its atoms (a cell in nm read as Å). Without periodic directions an
    atom has at most ``n_atoms - 1`` neighbours.
    """
    pbc = np.asarray(pbc, dtype=bool).reshape(3)
    k = int(pbc.sum())
    if k == 0:
        return
    rows = np.asarray(cell, dtype=np.float64)[pbc]
    measure = max(float(np.sqrt(abs(np.linalg.det(rows @ rows.T)))), 1e-300)  # length, area or volume
    ball = {1: 2.0 * cutoff, 2: np.pi * cutoff**2, 3: 4.0 / 3.0 * np.pi * cutoff**3}[k]
    estimate = ball / measure * (len(positions) if k == 3 else 1)
    if estimate > MAX_NEIGHBORS_ESTIMATE:
        what = {
            1: f"a periodic length of {measure:.3g} Å",
            2: f"a periodic area of {measure:.3g} Å^2",
            3: f"a volume of {measure:.3g} Å^3",
        }[k]
        raise ValueError(
            f"{label}: {len(positions)} atom(s) in a cell of {what} would give each atom about "
            f"{estimate:.3g} neighbours within the {cutoff:g} Å cutoff; the cell is almost singular or "
            f"not in Å (cell={np.asarray(cell).tolist()})"
        )


# Closer than this, two atoms are taken to be at the same place (round-off of an
# atom put on a periodic image of another); metatrain's PET still gives finite
# numbers down to ~1e-9 Å, and ZBL's ~1e12 eV there.
COINCIDENT = 1e-10


def check_coincident(positions, cell, centers, neighbors, shifts, label: str = "structure") -> None:
    """Raise a ``ValueError`` naming the first pair of atoms at the same place.

    Their edge vector is zero: PET's edge features and cutoff factors are then
    arbitrary (metatrain gives a finite, meaningless energy) and ZBL's repulsion is
    infinite, so there is no energy to return.
    """
    if len(centers) == 0:
        return
    vectors = positions[neighbors] - positions[centers] + shifts @ cell
    close = np.flatnonzero((vectors**2).sum(axis=1) < COINCIDENT**2)
    if close.size:
        e = close[0]
        i, j, shift = int(centers[e]), int(neighbors[e]), shifts[e].tolist()
        where = "" if not any(shift) else f" (atom {j} through the periodic image shifted by {shift} cells)"
        raise ValueError(
            f"{label}: atoms {i} and {j} are at the same place{where}; PET has no energy for coinciding atoms"
        )


def edge_list(positions, cell, pbc, cutoff: float):
    """Full neighbour list of one structure with vesin: (centers, neighbors, shifts).

    Pairs are within ``cutoff`` (strict); periodic images of an atom itself are
    included, the zero-shift self pair is not. ``cell`` rows for non-periodic
    directions are ignored.
    """
    from vesin import NeighborList

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
    ``long_range`` is a ready :class:`petfunc.model.long_range.LongRange` (or None).
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
