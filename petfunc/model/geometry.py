"""Edge geometry inside the differentiated energy: edge vectors and cutoff factors.

An edge ``(i, j, S)`` of :class:`~petfunc.graph.Neighbors` has the vector
``r_e = x_j - x_i + S @ cell`` (cell rows are lattice vectors); its switching
function uses the fixed cutoff, or the adaptive pair radii.
"""

from __future__ import annotations

import torch

from petfunc.config import PETConfig
from petfunc.graph.neighbors import Neighbors
from petfunc.model import adaptive
from petfunc.model.cutoff import switching_function


def edge_vectors(positions: torch.Tensor, cell: torch.Tensor, neighbors: Neighbors) -> torch.Tensor:
    """``[n_edges, 3]`` vectors r_e = x_j - x_i + S @ cell (Å)."""
    shifts = neighbors.cell_shifts.to(positions.dtype)
    cells = cell[neighbors.structure_index[neighbors.centers]]  # [n_edges, 3, 3]
    lattice = torch.einsum("ea,eab->eb", shifts, cells)
    return positions[neighbors.neighbors] - positions[neighbors.centers] + lattice


def cutoff_factors(config: PETConfig, distances: torch.Tensor, neighbors: Neighbors) -> torch.Tensor:
    """``[n_edges]`` switching function f_e, with the adaptive pair radii if enabled."""
    if config.adaptive:
        radii = adaptive.atomic_cutoffs(config, neighbors.centers, distances, neighbors.n_atoms)
        r_cut = 0.5 * (radii[neighbors.centers] + radii[neighbors.neighbors])
    else:
        r_cut = config.cutoff
    return switching_function(config.cutoff_function)(distances, r_cut, config.cutoff_width)
