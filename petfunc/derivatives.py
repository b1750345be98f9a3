"""Forces and stress as derivatives of any energy function, by ``torch.func.grad``.

An energy function has the signature ``energy_fn(params, positions, cell, neighbors)
-> [n_structures]`` (eV, positions in Å, cell rows as lattice vectors). The
transformations here return functions with that same signature.

Stress uses a per-structure strain eps (identity at evaluation):
``x' = x eps``, ``cell' = cell eps``, and ``stress = (1 / V) dE/d eps`` in eV/Å^3, the
sign convention of ASE and metatomic: the stress is positive when stretching the
cell raises the energy (a cell under tension). ``V = |det cell|``. For a structure that is not
periodic in all three directions V is 0 and its stress is NaN, by definition.
The strain derivative of PET is not symmetric (PET is not rotation-equivariant);
it is returned as is, like metatrain does.
"""

from __future__ import annotations

import torch
from torch.func import grad


def cell_volume(cell: torch.Tensor) -> torch.Tensor:
    """``[n_structures]`` |a . (b x c)| of each cell (a triple product: exportable)."""
    return torch.linalg.cross(cell[:, 0], cell[:, 1], dim=-1).mul(cell[:, 2]).sum(-1).abs()


def _strained(positions, cell, strain, structure_index):
    positions = torch.einsum("ia,iab->ib", positions, strain[structure_index])
    return positions, torch.matmul(cell, strain)


def _identity_strain(cell: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(3, dtype=cell.dtype, device=cell.device)
    return eye.expand(cell.shape[0], 3, 3).clone()


def forces(energy_fn):
    """``fn(params, positions, cell, neighbors) -> forces [n_atoms, 3]`` (eV/Å)."""

    def fn(params, positions, cell, neighbors):
        def total(x):
            return energy_fn(params, x, cell, neighbors).sum()

        return -grad(total)(positions)

    return fn


def energy_and_forces(energy_fn):
    """``fn(...) -> (energy [n_structures], forces [n_atoms, 3])``."""

    def fn(params, positions, cell, neighbors):
        def total(x):
            e = energy_fn(params, x, cell, neighbors)
            return e.sum(), e

        de_dx, energies = grad(total, has_aux=True)(positions)
        return energies, -de_dx

    return fn


def _position_and_strain_grad(terms_fn, params, positions, cell, neighbors):
    """``(terms, dE/dx, dE/d eps)`` at the identity strain, where ``terms = terms_fn(params,
    x, cell, neighbors)`` is a tuple whose first item is the energy [n_structures]."""
    strain = _identity_strain(cell)

    def total(x, eps):
        xs, cs = _strained(x, cell, eps, neighbors.structure_index)
        terms = terms_fn(params, xs, cs, neighbors)
        return terms[0].sum(), terms

    (de_dx, de_deps), terms = grad(total, argnums=(0, 1), has_aux=True)(positions, strain)
    return terms, de_dx, de_deps


def energy_forces_strain_derivative(energy_fn):
    """``fn(...) -> (energy, forces, dE/d strain [n_structures, 3, 3])``.

    The strain derivative is the (negative) virial W = -dE/d eps and is finite for
    every structure, periodic or not.
    """

    def energy_only(*args):
        return (energy_fn(*args),)

    def fn(params, positions, cell, neighbors):
        (energies,), de_dx, de_deps = _position_and_strain_grad(energy_only, params, positions, cell, neighbors)
        return energies, -de_dx, de_deps

    return fn


def energy_terms_forces_strain_derivative(terms_fn):
    """``fn(...) -> (energy, per-atom energies, forces, dE/d eps)`` from one pass.

    ``terms_fn(params, positions, cell, neighbors) -> (energy [n_structures],
    per-atom energies [n_atoms])``, e.g. :meth:`petfunc.PET.energy_terms`. As
    :func:`energy_forces_strain_derivative`; the per-atom energies come from the same
    forward pass (no second evaluation).
    """

    def fn(params, positions, cell, neighbors):
        (energy, per_atom), de_dx, de_deps = _position_and_strain_grad(terms_fn, params, positions, cell, neighbors)
        return energy, per_atom, -de_dx, de_deps

    return fn


def energy_forces_stress(energy_fn):
    """``fn(...) -> (energy [n_structures], forces [n_atoms, 3], stress [n_structures, 3, 3])``.

    Stress is ``(1/V) dE/d eps`` (eV/Å^3), NaN for structures that are not fully
    periodic (zero cell volume).
    """
    inner = energy_forces_strain_derivative(energy_fn)

    def fn(params, positions, cell, neighbors):
        energies, f, de_deps = inner(params, positions, cell, neighbors)
        volume = cell_volume(cell)
        safe = torch.where(volume > 0, volume, torch.ones_like(volume))
        stress = de_deps / safe[:, None, None]
        stress = torch.where((volume > 0)[:, None, None], stress, torch.full_like(stress, float("nan")))
        return energies, f, stress

    return fn
