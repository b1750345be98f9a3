"""Checks of a structure before its neighbour graph is built, and of a graph's sizes.

Each check raises a ``ValueError`` that names the structure and the problem, where
the alternative would be a cryptic error deep in the model, a neighbour list that
exhausts the memory, or a meaningless number.
"""

from __future__ import annotations

import numpy as np

from petfunc.graph.neighbors import Neighbors


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
