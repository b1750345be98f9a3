"""Training on second derivatives: a loss with a Hessian-vector-product term.

Labels are Hessian-vector products ``t_p = H d_p`` for a few probe directions d_p
per batch (with unit vectors as probes, rows of the Hessian: full Hessian
matching; with random probes, a stochastic estimate of it at the memory cost
of a few force evaluations). A :class:`HessianBatch` carries them next to an
ordinary :class:`~petfunc.data.Batch`; the loss is

``L = L_E + L_F + L_S  (as petfunc.make_loss)  +  w_H mean_{p,i,a} l((H d_p)_ia, t_pia)``

with ``H d_p`` the vjp of the model's position gradient with d_p, computed
together with the forces and the strain derivative (reverse-over-reverse: the
gradient and its graph once, then one vmapped pullback per probe). The parameter
gradient of ``L`` is therefore a third derivative of the energy. The default
training path (:func:`petfunc.make_loss`) is unchanged; this module is only used
when there are Hessian labels.

Units: like the other targets of a batch, the HVP targets are in training units,
``H d / c`` with c the energy scale (:func:`hessian_batch` divides).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.func import grad, vjp, vmap

from petfunc.compile import symbolic_vmap_rules
from petfunc.data import Batch
from petfunc.derivatives import energy_forces_strain_derivative
from petfunc.train.loss import LossTerm, LossWeights, atoms_per_structure, term_loss, training_energy
from petfunc.train.step import grad_step_of, train_step_of


class HessianBatch(NamedTuple):
    """A training batch with Hessian-vector-product labels.

    Attributes:
        batch: the ordinary batch (energies, forces, stress in training units).
        directions: ``[n_probes, n_atoms, 3]`` probe vectors d_p (Å or unitless;
            zero on atoms that carry no label).
        hvp: ``[n_probes, n_atoms, 3]`` targets ``H d_p / c`` (NaN where missing).
    """

    batch: Batch
    directions: torch.Tensor
    hvp: torch.Tensor


def hessian_batch(
    batch: Batch, directions: torch.Tensor, hvp: torch.Tensor, scale: float = 1.0
) -> HessianBatch:
    """Build a :class:`HessianBatch`; ``hvp`` (eV/Å^2 times d) is divided by ``scale``.

    ``directions`` and ``hvp`` may be ``[n_atoms, 3]`` (one probe) or
    ``[n_probes, n_atoms, 3]``. Pass a padding structure's rows as NaN (or use
    :func:`hvp_targets` on a batch Hessian, which gives exact values there).
    """
    dtype, device = batch.positions.dtype, batch.positions.device
    directions = torch.as_tensor(directions, dtype=dtype, device=device)
    hvp = torch.as_tensor(hvp, dtype=dtype, device=device) / scale
    if directions.dim() == 2:
        directions, hvp = directions[None], hvp[None]
    n_atoms = batch.positions.shape[0]
    if directions.shape[1:] != (n_atoms, 3) or hvp.shape != directions.shape:
        raise ValueError(
            f"directions {tuple(directions.shape)} and hvp {tuple(hvp.shape)} must both be "
            f"[n_probes, {n_atoms}, 3]"
        )
    return HessianBatch(batch, directions, hvp)


def hvp_targets(hessian_matrix: torch.Tensor, directions: torch.Tensor) -> torch.Tensor:
    """``H d_p`` ``[n_probes, n_atoms, 3]`` from a reference Hessian ``[n_atoms, 3, n_atoms, 3]``."""
    n = hessian_matrix.shape[0]
    flat = hessian_matrix.reshape(3 * n, 3 * n)
    return (directions.reshape(-1, 3 * n) @ flat.T).reshape(directions.shape)


def _derivatives_and_hvp(energy_fn, params, batch: Batch, directions, with_strain: bool):
    """(energies, -dE/dx, dE/d eps or None, H d [n_probes, n_atoms, 3]) in one pass."""
    cell, neighbors = batch.cell, batch.neighbors

    if with_strain:
        efs = energy_forces_strain_derivative(energy_fn)

        def position_gradient(x):
            energies, forces, de_deps = efs(params, x, cell, neighbors)
            return -forces, (energies, de_deps)

    else:

        def total(x):
            e = energy_fn(params, x, cell, neighbors)
            return e.sum(), e

        gradient = grad(total, has_aux=True)

        def position_gradient(x):
            de_dx, energies = gradient(x)
            return de_dx, (energies,)

    # reverse-over-reverse: g = dE/dx and its graph once, then one vjp per probe
    # (forward-over-reverse would bake sizes into traces, see petfunc.hessian)
    de_dx, pullback, aux = vjp(position_gradient, batch.positions, has_aux=True)
    hd = vmap(pullback)(directions)[0]
    de_deps = aux[1] if with_strain else None
    return aux[0], -de_dx, de_deps, hd


def make_hessian_loss(
    energy_fn: Callable,
    weights: LossWeights = LossWeights(),
    hvp_weight: float = 1.0,
    hvp_type: str = "mse",
):
    """``loss_fn(params, hessian_batch) -> (loss, metrics)``: :func:`petfunc.make_loss`'s
    terms plus ``hvp_weight`` times the HVP term (see the module docstring).

    ``metrics`` has the keys of :func:`petfunc.make_loss` plus ``hvp_loss``,
    ``hvp_sse``, ``hvp_sae`` and ``hvp_count``.
    """
    energy_fn = training_energy(energy_fn)
    hvp_term = LossTerm(hvp_weight, hvp_type)  # validates weight and type

    def loss_fn(params, hbatch: HessianBatch):
        batch = hbatch.batch
        # layer norm decomposed: PyTorch's own third derivative of it is wrong
        with symbolic_vmap_rules(decompose_layer_norm=True):
            energies, forces, de_deps, hd = _derivatives_and_hvp(
                energy_fn, params, batch, hbatch.directions, with_strain=weights.stress.weight > 0
            )
        n_atoms = atoms_per_structure(weights, energies, batch)
        metrics: dict[str, torch.Tensor] = {}
        loss = torch.zeros((), dtype=energies.dtype, device=energies.device)
        terms = [("energy", weights.energy, energies / n_atoms, batch.energy / n_atoms)]
        if weights.forces.weight > 0:
            terms.append(("forces", weights.forces, forces, batch.forces))
        if weights.stress.weight > 0:
            per_atom = n_atoms[:, None, None]
            terms.append(("stress", weights.stress, de_deps / per_atom, batch.strain_derivative / per_atom))
        if hvp_term.weight > 0:
            terms.append(("hvp", hvp_term, hd, hbatch.hvp))
        for name, term, pred, target in terms:
            mean, sse, sae, count = term_loss(term, pred, target)
            loss = loss + term.weight * mean
            metrics.update(
                {f"{name}_loss": mean, f"{name}_sse": sse, f"{name}_sae": sae, f"{name}_count": count}
            )
        metrics["loss"] = loss
        return loss, metrics

    return loss_fn


def make_hessian_grad_step(
    energy_fn, weights: LossWeights = LossWeights(), hvp_weight: float = 1.0, hvp_type: str = "mse"
):
    """``grad_step(params, hessian_batch) -> (grads, metrics)`` of the trainable parameters."""
    return grad_step_of(make_hessian_loss(energy_fn, weights, hvp_weight, hvp_type))


def make_hessian_train_step(
    energy_fn,
    optimizer,
    weights: LossWeights = LossWeights(),
    hvp_weight: float = 1.0,
    hvp_type: str = "mse",
    grad_clip_norm: float | None = None,
):
    """``train_step(state, hessian_batch) -> (state, metrics)``: as
    :func:`petfunc.make_train_step`, with the loss of :func:`make_hessian_loss`."""
    grad_step = make_hessian_grad_step(energy_fn, weights, hvp_weight, hvp_type)
    return train_step_of(grad_step, optimizer, grad_clip_norm)
