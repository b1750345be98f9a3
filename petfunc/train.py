"""A pure training step: ``state, metrics = train_step(state, batch)``.

The step computes the parameter gradient of :func:`petfunc.loss.make_loss`'s loss
with ``torch.func.grad`` (a grad of the grad that gives forces and stress), clips
its global norm as ``torch.nn.utils.clip_grad_norm_`` does, and applies a torchopt
optimizer functionally. Composition weights and the energy scale are fitted, not
trained: they stay out of the gradient and the optimizer.
"""

from __future__ import annotations

import math
from typing import Any, Callable, NamedTuple

import torch
import torchopt
from torch.func import grad_and_value

from .loss import LossWeights, make_loss


FROZEN = ("composition_weights", "energy_scale")


class TrainState(NamedTuple):
    """Parameters (including the frozen composition and scale) and optimizer state."""

    params: Any
    opt_state: Any


def trainable(params):
    """The trained part of a PET parameter tree (everything but composition/scale)."""
    return {k: v for k, v in params.items() if k not in FROZEN}


def init_state(params, optimizer) -> TrainState:
    """``TrainState(params, optimizer.init(trainable(params)))``."""
    return TrainState(params, optimizer.init(trainable(params)))


def warmup_cosine(learning_rate: float, total_steps: int, warmup_fraction: float = 0.01) -> Callable:
    """metatrain's schedule as a torchopt schedule of the step count t:

    lr(t) = lr * t / T_w for t < T_w = floor(warmup_fraction * T), then
    lr * (1 + cos(pi (t - T_w) / (T - T_w))) / 2. Note lr(0) = 0.
    """
    total = max(int(total_steps), 1)
    warm = int(math.floor(warmup_fraction * total))

    def schedule(count):
        t = torch.as_tensor(count).to(torch.float64)
        ramp = t / max(1, warm)
        progress = (t - warm) / max(1, total - warm)
        cosine = 0.5 * (1.0 + torch.cos(math.pi * progress.clamp(0.0, 1.0)))
        return learning_rate * torch.where(t < warm, ramp, cosine)

    return schedule


def make_optimizer(schedule, weight_decay=None):
    """Adam (or AdamW when ``weight_decay`` is a float) with torch.optim's defaults."""
    if weight_decay is None:
        return torchopt.adam(schedule, betas=(0.9, 0.999), eps=1e-8)
    return torchopt.adamw(schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=float(weight_decay))


def clip_by_global_norm(grads, max_norm: float):
    """Scale a gradient tree so its global 2-norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: factor
    ``min(1, max_norm / (norm + 1e-6))``. Returns ``(clipped, norm)``.
    """
    leaves = torch.utils._pytree.tree_leaves(grads)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in leaves]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    return torch.utils._pytree.tree_map(lambda g: g * factor.to(g.dtype), grads), norm


def make_grad_step(energy_fn, weights: LossWeights = LossWeights()):
    """``grad_step(params, batch) -> (grads, metrics)`` of the trainable parameters.

    Gradients are plain outputs, so data-parallel training can all-reduce them
    between this step and :func:`apply_gradients`.
    """
    loss_fn = make_loss(energy_fn, weights)

    def grad_step(params, batch):
        frozen = {k: params[k] for k in FROZEN if k in params}

        def objective(train_params):
            return loss_fn({**train_params, **frozen}, batch)

        grads, (_, metrics) = grad_and_value(objective, has_aux=True)(trainable(params))
        return grads, metrics

    return grad_step


def apply_gradients(optimizer, state: TrainState, grads, grad_clip_norm: float = 1.0):
    """Clip ``grads`` and take one optimizer step: ``(new_state, grad_norm)``."""
    norm = None
    if grad_clip_norm is not None and math.isfinite(grad_clip_norm):
        grads, norm = clip_by_global_norm(grads, grad_clip_norm)
    params = state.params
    frozen = {k: params[k] for k in FROZEN if k in params}
    train_params = trainable(params)
    updates, opt_state = optimizer.update(grads, state.opt_state, params=train_params, inplace=False)
    new_params = torchopt.apply_updates(train_params, updates, inplace=False)
    return TrainState({**new_params, **frozen}, opt_state), norm


def make_train_step(
    energy_fn,
    optimizer,
    weights: LossWeights = LossWeights(),
    grad_clip_norm: float = 1.0,
):
    """``train_step(state, batch) -> (state, metrics)``, a pure function.

    Args:
        energy_fn: a :class:`~petfunc.PET` (its training-mode ``raw_energy`` is used)
            or an energy function in the batch's training units.
        optimizer: any torchopt ``GradientTransformation`` (schedules inside it).
        weights: the loss terms.
        grad_clip_norm: maximal global gradient norm (``None`` or ``inf``: no clipping).
    """
    grad_step = make_grad_step(energy_fn, weights)

    def train_step(state: TrainState, batch):
        grads, metrics = grad_step(state.params, batch)
        state, norm = apply_gradients(optimizer, state, grads, grad_clip_norm)
        if norm is not None:
            metrics = {**metrics, "grad_norm": norm}
        return state, metrics

    return train_step
