"""The frame the model computes in: a structure moved, in float64, close to the origin.

A float32 model rounds the positions before it forms edge vectors, so a coordinate
of 1e6 Å keeps about 0.06 Å of its digits: a molecule there gets forces wrong by
percents. The energy, the forces and the strain derivative do not change when a
whole structure is translated, nor, along periodic directions, when one atom is
moved by a lattice vector and its edges carry the opposite cell shift. So
:func:`model_frame` moves each structure, in float64 and before any cast:

* along non-periodic directions, its centroid to the origin;
* along periodic directions, by the lattice vector that brings its centroid into
  the cell; then any atom still more than one cell outside the cell
  (:data:`FAR_CELLS`) by a lattice vector into it, with its edges' cell shifts
  changed to match.

The edge vectors ``positions[j] - positions[i] + S @ cell`` are those of the
structure as given, to float64 round-off. Atoms near their cell, as most structures
have them, keep their cell shifts; a whole-lattice translation leaves long-range
sums (Ewald, P3M) as they are.
"""

from __future__ import annotations

import numpy as np


#: Atoms whose fractional coordinate along a periodic direction is below
#: ``-FAR_CELLS`` or at least ``1 + FAR_CELLS`` (after the structure's translation)
#: are moved into the cell: coordinates of a few cells lose no more float32 digits
#: than those of the cell itself, and keep the cell shifts the user's list has.
FAR_CELLS = 1.0


def _fractional(points: np.ndarray, periodic: np.ndarray) -> np.ndarray:
    """``[n, k]`` coordinates of ``points [n, 3]`` along the ``k`` periodic rows
    (least squares: the components outside their span are ignored)."""
    return np.linalg.lstsq(periodic.T, points.T, rcond=None)[0].T


def model_frame(positions, cell, pbc, centers, neighbors, shifts):
    """One structure in the model's frame (see the module docstring).

    Args:
        positions: ``[n_atoms, 3]`` (Å).
        cell: ``[3, 3]`` lattice vectors as rows; rows of non-periodic directions
            are ignored.
        pbc: ``[3]`` periodic directions (or one for all three).
        centers, neighbors, shifts: the structure's edge list ``[n_edges]``,
            ``[n_edges]``, ``[n_edges, 3]`` (integer cell shifts S).
    Returns:
        ``(positions [n_atoms, 3] float64, shifts [n_edges, 3] int64)``: every edge
        vector is unchanged; ``shifts`` is a new array only where an atom was moved
        into the cell.
    """
    positions = np.asarray(positions, dtype=np.float64)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    shifts = np.asarray(shifts, dtype=np.int64).reshape(-1, 3)
    centroid = positions.mean(axis=0)
    if not pbc.any():
        return positions - centroid, shifts
    periodic = np.asarray(cell, dtype=np.float64).reshape(3, 3)[pbc]
    basis = np.linalg.qr(periodic.T)[0]  # [3, k] orthonormal span of the periodic rows
    # the centroid's non-periodic part (none, not round-off, for a crystal)
    across = 0.0 if pbc.all() else centroid - basis @ (basis.T @ centroid)
    lattice = np.floor(_fractional(centroid[None], periodic)[0]) @ periodic
    positions = positions - (across + lattice)
    fractional = _fractional(positions, periodic)
    far = np.any((fractional < -FAR_CELLS) | (fractional >= 1.0 + FAR_CELLS), axis=1)
    if not far.any():
        return positions, shifts
    moved = np.zeros((len(positions), 3), dtype=np.int64)  # lattice vectors taken off each atom
    moved[np.ix_(far, np.flatnonzero(pbc))] = np.floor(fractional[far]).astype(np.int64)
    positions = positions - moved[:, pbc] @ periodic
    # r_j - r_i + S @ cell is unchanged when r_a loses n_a @ cell and S gains n_j - n_i
    centers = np.asarray(centers, dtype=np.int64)
    neighbors = np.asarray(neighbors, dtype=np.int64)
    return positions, shifts + moved[neighbors] - moved[centers]


def check_rigid_motion(
    reference, positions, reference_cell, cell, pbc, label: str = "structure", tolerance: float = 1e-8
) -> None:
    """Raise a ``ValueError`` unless ``positions`` (and ``cell``) are a rigid motion
    (rotation, reflection, translation) of ``reference`` (and ``reference_cell``).

    A neighbour list stays valid under such a motion only: any other change of the
    geometry may bring pairs into the cutoff or take them out of it. The best
    orthogonal fit (Procrustes, of the centred positions and the periodic cell rows)
    must reproduce them within ``tolerance`` times the structure's size (at least 1 Å).

    Args:
        reference, positions: ``[n_atoms, 3]`` (Å): those the list was built for, and
            the new ones.
        reference_cell, cell: ``[3, 3]`` rows; only the periodic rows are compared.
        pbc: ``[3]`` periodic directions (or one for all three).
    """
    reference = np.asarray(reference, dtype=np.float64)
    positions = np.asarray(positions, dtype=np.float64)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,))
    if positions.shape != reference.shape:
        raise ValueError(
            f"{label}: positions of shape {positions.shape} replace ones of shape {reference.shape}; "
            "its neighbour list is for the latter: build the structure again for the new atoms"
        )
    a = reference - reference.mean(axis=0)
    b = positions - positions.mean(axis=0)
    rows_a = np.asarray(reference_cell, dtype=np.float64).reshape(3, 3)[pbc]
    rows_b = np.asarray(cell, dtype=np.float64).reshape(3, 3)[pbc]
    u, _, vt = np.linalg.svd(a.T @ b + rows_a.T @ rows_b)
    rotation = u @ vt
    atom_error = float(np.abs(a @ rotation - b).max(initial=0.0))
    cell_error = float(np.abs(rows_a @ rotation - rows_b).max(initial=0.0))
    size = max(1.0, float(np.abs(a).max(initial=0.0)), float(np.abs(rows_a).max(initial=0.0)))
    if max(atom_error, cell_error) > tolerance * size:
        what = (
            f"an atom is {atom_error:.3g} Å"
            if atom_error >= cell_error
            else f"a cell row is {cell_error:.3g} Å"
        )
        raise ValueError(
            f"{label}: the new positions and cell are not a rigid motion of those its neighbour list "
            f"was built for ({what} away from the best rotation of them), so the list is stale: build "
            "the structure again at the new positions (petfunc.prepare or prepare_atoms)"
        )
