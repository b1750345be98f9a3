"""ZBL short-range repulsion (``PETConfig(zbl=True)``), as metatrain's ``ZBL`` additive model.

For a pair of atoms with atomic numbers Z_i, Z_j at distance r (Å) the universal
Ziegler-Biersack-Littmark screened Coulomb energy is

    E(r) = K / r * phi(r / a),     phi(x) = sum_k c_k exp(-d_k x),
    K = 14.399645478425668 Z_i Z_j  (eV Å),     a = 0.4685 / (Z_i^0.23 + Z_j^0.23)  (Å),

with c = (0.02817, 0.28022, 0.50986, 0.18175) and d = (0.20162, 0.40290, 0.94229,
3.19980). As in LAMMPS ``pair_style zbl`` with an inner cutoff of 0, a polynomial
``S(r) = A/3 r^3 + B/4 r^4 + C`` is added so that the pair energy and its first two
derivatives vanish at the pair cutoff ``r_c = R_i + R_j`` (ASE covalent radii), and the
energy is exactly 0 beyond it:

    A = (-3 E'(r_c) + r_c E''(r_c)) / r_c^2,   B = (2 E'(r_c) - r_c E''(r_c)) / r_c^3,
    C = -E(r_c) + r_c E'(r_c) / 2 - r_c^2 E''(r_c) / 12.

The neighbour list is full (each pair twice), so each edge carries half its pair
energy, credited to its centre atom; summing per-atom energies gives the structure's
ZBL energy. metatrain requests a list of radius ``2 max_t R_t``; petfunc's flat list
(:func:`petfunc.structures.list_cutoff`) is at least that long, and any longer pair is
masked to 0 here.

Precision note: metatrain's atomic numbers are ``int32``, so ``Z^0.23``, ``a`` and
``K`` are evaluated in torch's *default* float dtype (float32 unless changed) before
meeting the float64 distances. :func:`atomic_energies` does the same, in the same
order of operations. This cannot be bit-for-bit in general, because metatrain is not
reproducible there itself: on CPU, torch's float32 ``pow`` gives results 1 ulp apart
in its SIMD lanes and in the scalar tail of a kernel, so which value a pair gets
depends on its position in the concatenated pair list, that is on the rest of the
batch (measured: the same Au-Fe cell's ZBL energy differs by 2e-8 relative in
metatrain alone and batched). ``a`` then enters ``exp(-r d / a)`` with a factor
``r d / a`` of up to ~40 for heavy pairs, so ZBL energies and forces agree with
metatrain's to ~1e-7 relative rather than to float64 round-off (the PET part does).
"""

from __future__ import annotations

import functools
import logging

import torch
from ase.data import covalent_radii as ase_radii

from petfunc.config import PETConfig
from petfunc.graph.neighbors import Neighbors
from petfunc.model.geometry import edge_vectors


COULOMB = 14.399645478425668  # e^2 / (4 pi eps_0) in eV Å
SCREENING_LENGTH = 0.46850  # Å
SCREENING_POWER = 0.23
PHI_COEFFICIENTS = (0.02817, 0.28022, 0.50986, 0.18175)
PHI_EXPONENTS = (0.20162, 0.40290, 0.94229, 3.19980)
ASE_DEFAULT_RADIUS = 0.2  # what ASE tabulates for elements without a covalent radius

_logger = logging.getLogger(__name__)


@functools.cache
def covalent_radii(atomic_types: tuple[int, ...]) -> tuple[float, ...]:
    """ASE covalent radii (Å) of ``atomic_types``, in that order.

    Elements without a tabulated radius have ASE's placeholder 0.2 Å, which is used
    as is (with a warning), as metatrain does.
    """
    radii = []
    for z in atomic_types:
        z = int(z)
        if z < 0 or z >= len(ase_radii):
            raise ValueError(f"no covalent radius for atomic number {z}")
        radius = float(ase_radii[z])
        if radius == ASE_DEFAULT_RADIUS:
            _logger.warning(
                "Covalent radius for element %d is not available in ASE. Using a default value of 0.2 Å.",
                z,
            )
        radii.append(radius)
    return tuple(radii)


def zbl_cutoff(config: PETConfig) -> float:
    """metatrain's ZBL neighbour-list radius: twice the largest covalent radius (Å)."""
    return 2.0 * max(covalent_radii(tuple(config.atomic_types)))


def _screening_sums(r: torch.Tensor, da: torch.Tensor, c: torch.Tensor):
    """phi, phi', phi'' at distances ``r [E]``; ``da = d / a`` is ``[E, 4]``."""
    terms = c * torch.exp(-r[:, None] * da)  # [E, 4]
    phi = terms.sum(dim=1)
    dphi = -(terms * da).sum(dim=1)
    d2phi = (terms * da * da).sum(dim=1)
    return phi, dphi, d2phi


def pair_energies(
    z_i: torch.Tensor,
    z_j: torch.Tensor,
    r: torch.Tensor,
    r_c: torch.Tensor,
) -> torch.Tensor:
    """Switched ZBL energy of each pair ``[E]`` (eV), exactly 0 for ``r > r_c``.

    This is the full pair energy, not halved.

    Args:
        z_i, z_j: ``[E]`` integer atomic numbers. ``a`` and ``K`` are computed from
            them in torch's default float dtype, as metatrain does with int32 types.
        r: ``[E]`` positive distances (Å).
        r_c: ``[E]`` pair cutoffs (Å), same dtype as ``r``.
    """
    dtype, device = r.dtype, r.device
    c = torch.tensor(PHI_COEFFICIENTS, dtype=dtype, device=device)
    d = torch.tensor(PHI_EXPONENTS, dtype=dtype, device=device)
    # integer -> default float dtype, in metatrain's order of operations
    a = SCREENING_LENGTH / (z_i**SCREENING_POWER + z_j**SCREENING_POWER)
    prefactor = (COULOMB * z_i * z_j).to(dtype)
    da = d / a.to(dtype)[:, None]  # [E, 4]

    inside = r <= r_c
    # keep the masked branch finite (its gradient is discarded by the where)
    r_in = torch.where(inside, r, r_c)

    phi, dphi, _ = _screening_sums(r_in, da, c)
    energy = prefactor / r_in * phi

    phi_c, dphi_c, d2phi_c = _screening_sums(r_c, da, c)
    e_c = prefactor / r_c * phi_c
    de_c = prefactor / r_c * (dphi_c - phi_c / r_c)
    d2e_c = prefactor / r_c * (d2phi_c - 2.0 / r_c * dphi_c + 2.0 * phi_c / (r_c * r_c))

    coef_a = (r_c * d2e_c - 3.0 * de_c) / (r_c * r_c)
    coef_b = (2.0 * de_c - r_c * d2e_c) / (r_c * r_c * r_c)
    coef_c = -e_c + r_c * de_c / 2.0 - r_c * r_c * d2e_c / 12.0
    r3 = r_in * r_in * r_in
    energy = energy + coef_a / 3.0 * r3 + coef_b / 4.0 * (r3 * r_in) + coef_c
    return torch.where(inside, energy, torch.zeros_like(energy))


def atomic_energies(positions, cell, neighbors: Neighbors, config: PETConfig) -> torch.Tensor:
    """ZBL energy of each atom ``[n_atoms]`` (eV): half of every pair it is centre of.

    Pure, differentiable twice and traceable with ``make_fx`` (fixed shapes, no masks
    by indexing, no ``.item()``).

    Args:
        positions: ``[n_atoms, 3]`` (Å).
        cell: ``[n_structures, 3, 3]`` lattice vectors as rows.
        neighbors: the graph; its flat *full* edge list must contain every pair
            closer than :func:`zbl_cutoff` (longer pairs contribute 0).
        config: gives ``atomic_types``.
    """
    dtype, device = positions.dtype, positions.device
    vectors = edge_vectors(positions, cell, neighbors)
    types = tuple(config.atomic_types)
    numbers = torch.tensor(types, dtype=torch.int32, device=device)
    radii = torch.tensor(covalent_radii(types), dtype=dtype, device=device)
    s_i = neighbors.species[neighbors.centers]
    s_j = neighbors.species[neighbors.neighbors]
    r_c = radii[s_i] + radii[s_j]

    r2 = (vectors * vectors).sum(dim=-1)
    # a zero-length edge (padding; never a real pair) contributes 0 with finite gradients
    real = r2 > 0
    r = torch.sqrt(torch.where(real, r2, r_c * r_c))
    pair = pair_energies(numbers[s_i], numbers[s_j], r, r_c)
    pair = torch.where(real, pair, torch.zeros_like(pair))

    out = torch.zeros(positions.shape[0], dtype=dtype, device=device)
    return out.scatter_add(0, neighbors.centers, 0.5 * pair)


def energy(positions, cell, neighbors: Neighbors, config: PETConfig) -> torch.Tensor:
    """ZBL energy of each structure ``[n_structures]`` (eV)."""
    per_atom = atomic_energies(positions, cell, neighbors, config)
    out = torch.zeros(cell.shape[0], dtype=per_atom.dtype, device=per_atom.device)
    return out.scatter_add(0, neighbors.structure_index, per_atom)
