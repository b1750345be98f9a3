"""LLPR uncertainties: metatrain's last-layer prediction rigidity, as PET-MAD ships it.

An LLPR checkpoint (``architecture_name: llpr``) wraps a trained PET and adds, for
the energy, computed from the last-layer features ``f_s`` of each structure (the
per-atom :func:`petfunc.model.last_layer_features` summed over its atoms):

* ``energy_uncertainty``: ``sigma_s = alpha * sqrt(f_s^T (L L^T)^{-1} f_s)`` with the
  Cholesky factor ``L`` of the (regularised) feature covariance and the calibrated
  multiplier ``alpha``;
* ``energy_ensemble``: K members ``E_s + (W_k - mean_k W_k) . f_s`` with ensemble
  last-layer weights ``W [K, F]`` drawn at calibration, centred on the model's own
  energy ``E_s``; their forces and stresses are derivatives of these energies.

The LLPR quantities are a pytree (a dict of tensors), like the parameters::

    config, params, llpr = petfunc.llpr.from_metatrain("pet-mad.ckpt")
    energy, sigma = petfunc.llpr.energy_and_uncertainty(config)(params, llpr, positions, cell, neighbors)
    energies, forces, strain = petfunc.llpr.ensemble(config)(params, llpr, positions, cell, neighbors)

Everything is a pure function of positions built with ``torch.func``, so it
composes with ``grad``, ``vmap`` and :func:`petfunc.compile` like the energy.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.func import vjp, vmap

from petfunc.compile import symbolic_vmap_rules
from petfunc.config import PETConfig
from petfunc.derivatives import energy_forces_strain_derivative, identity_strain, strained
from petfunc.io.metatrain import read_metatrain
from petfunc.model import PET, last_layer_features


__all__ = [
    "from_metatrain",
    "structure_features",
    "uncertainty",
    "energy_and_uncertainty",
    "ensemble",
    "ensemble_offsets",
]


def from_metatrain(source, dtype: torch.dtype | None = None, target: str | None = None):
    """``(config, params, llpr)`` of a metatrain LLPR checkpoint wrapping a PET.

    ``llpr`` holds ``cholesky`` ``[F, F]`` (lower-triangular), ``multiplier`` (a
    scalar) and ``ensemble_weights`` ``[K, F]`` (absent if the checkpoint has no
    ensemble), in ``dtype`` (default: the network's). ``target`` is the energy
    target whose uncertainty is read (default as for :func:`petfunc.from_metatrain`).
    """
    return read_metatrain(source, dtype, target, llpr="required")


def structure_features(config: PETConfig) -> Callable:
    """``fn(params, positions, cell, neighbors) -> [n_structures, F]``: last-layer
    features summed over each structure's atoms."""

    def fn(params, positions, cell, neighbors):
        per_atom = last_layer_features(params, positions, cell, neighbors, config)
        out = torch.zeros((cell.shape[0], per_atom.shape[1]), dtype=per_atom.dtype, device=per_atom.device)
        return out.index_add(0, neighbors.structure_index, per_atom)

    return fn


def uncertainty(llpr: dict[str, torch.Tensor], features: torch.Tensor) -> torch.Tensor:
    """``[n_structures]`` calibrated standard deviations ``alpha |L^{-1} f_s|`` (eV)."""
    v = torch.linalg.solve_triangular(llpr["cholesky"], features.T, upper=False)
    return llpr["multiplier"] * torch.sqrt((v * v).sum(dim=0))


def energy_and_uncertainty(config: PETConfig) -> Callable:
    """``fn(params, llpr, positions, cell, neighbors) -> (energy [S], sigma [S])``."""
    model = PET(config)
    features_fn = structure_features(config)

    def fn(params, llpr, positions, cell, neighbors):
        return model.energy(params, positions, cell, neighbors), uncertainty(
            llpr, features_fn(params, positions, cell, neighbors)
        )

    return fn


def ensemble_offsets(config: PETConfig, stress: bool = False) -> Callable:
    """``fn(params, llpr, positions, cell, neighbors) -> (features [S, F], dE [S, K],
    dF [K, N, 3], dW [K, S, 3, 3] or None)``: the structures' last-layer features
    (:func:`uncertainty` turns them into sigma) and what each ensemble member adds to
    the model's energy, forces and strain derivative. It traces with
    :func:`petfunc.compile` (sigma's triangular solve does not, so it stays outside).

    Member k adds ``(W_k - mean W) . f`` to the energy; the K force (and strain)
    offsets are the gradients of these, from one vmapped pullback of the features.
    """
    features_fn = structure_features(config)

    def fn(params, llpr, positions, cell, neighbors):
        weights = llpr["ensemble_weights"]
        delta = weights - weights.mean(dim=0, keepdim=True)  # [K, F]

        def features_of(x, eps):
            # strained as in petfunc.derivatives, so d/d eps is the strain derivative
            xs, cs = strained(x, cell, eps, neighbors.structure_index)
            return features_fn(params, xs, cs, neighbors)

        # symbolic-size batching rules: traced, the vmapped pullback keeps the data
        # sizes symbolic (PyTorch's own rules bake some of them into views)
        with symbolic_vmap_rules():
            features, pullback = vjp(features_of, positions, identity_strain(cell))
            # cotangent of member k: delta_k on every structure's features
            cotangents = delta[:, None, :].expand(-1, features.shape[0], -1)
            d_dx, d_deps = vmap(pullback)(cotangents)
        return features, features @ delta.T, -d_dx, (d_deps if stress else None)

    return fn


def ensemble(config: PETConfig, stress: bool = False) -> Callable:
    """``fn(params, llpr, positions, cell, neighbors) -> (energies [S, K],
    forces [K, N, 3], strain_derivative [K, S, 3, 3] or None)`` of the LLPR ensemble:
    the model's values plus :func:`ensemble_offsets`. The strain derivative (dE/d
    eps; stress = this / volume) only with ``stress=True``.
    """
    base = energy_forces_strain_derivative(PET(config).energy)
    offsets = ensemble_offsets(config, stress)

    def fn(params, llpr, positions, cell, neighbors):
        energy, forces, strain = base(params, positions, cell, neighbors)
        _, d_energy, d_forces, d_strain = offsets(params, llpr, positions, cell, neighbors)
        return (
            energy[:, None] + d_energy,
            forces[None] + d_forces,
            strain[None] + d_strain if stress else None,
        )

    return fn


# ---------------------------------------------------------------------------------------
