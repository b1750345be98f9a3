"""Ensembles (committees) of models evaluated and trained together with ``torch.func.vmap``.

An ensemble is one parameter tree whose every leaf has a leading member axis of
size K (:func:`init`, or :func:`petfunc.tree.stack` of K trees). The transformations
here vmap a single-model function over that axis, with the data shared by all members:

* ``energy_forces_stress(energy_fn)(params, positions, cell, neighbors)`` gives
  per-member energies ``[K, n_structures]``, forces ``[K, n_atoms, 3]`` and stress
  ``[K, n_structures, 3, 3]``; ``committee(energy_fn)`` their mean and spread;
* ``make_train_step(model, optimizer, ...)`` trains K members in one step: a vmap of
  :func:`petfunc.make_train_step` over parameters and optimizer state, the batch
  shared by all members (or, with ``member_batches=True``, one batch per member
  that shares the neighbour graph: per-member augmentation or label noise).

All of them trace with :func:`petfunc.compile` into one graph that serves every
batch shape: the vmap runs under petfunc's symbolic batching rules, which replace
the few PyTorch batching rules that would otherwise bake the trace batch's sizes
into the graph, and never let an index operation write into an expanded tensor
(which inductor miscompiles).

>>> model = petfunc.PET(config)
>>> params = petfunc.ensemble.init(model, seeds=range(8))
>>> c = petfunc.ensemble.committee(model.energy)(params, positions, cell, neighbors)
>>> c.energy, c.energy_std          # [n_structures] each
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch
from torch.func import vmap

from petfunc import tree
from petfunc.compile import symbolic_vmap_rules
from petfunc.data import Batch
from petfunc.derivatives import energy_forces_stress as _single_energy_forces_stress
from petfunc.train import LossWeights, TrainState
from petfunc.train import init_state as _single_init_state
from petfunc.train import make_train_step as _single_train_step


# ---------------------------------------------------------------------------------------
# parameters


def init(model, seeds: Sequence[int], dtype: torch.dtype = torch.float32, device=None):
    """Parameters of ``len(seeds)`` independently initialised members, stacked.

    Args:
        model: a :class:`~petfunc.PET` (anything with ``init(seed=, dtype=, device=)``).
        seeds: one seed per member.
    Returns:
        a parameter tree whose leaves have a leading member axis ``[K, ...]``.
    """
    seeds = list(seeds)
    if len(seeds) < 2:
        raise ValueError(f"an ensemble needs at least 2 members, got seeds={seeds}")
    return tree.stack([model.init(seed=int(s), dtype=dtype, device=device) for s in seeds])


def size(params) -> int:
    """Number of members K of a stacked parameter tree."""
    return next(iter(tree.flatten(params).values())).shape[0]


def init_state(params, optimizer, train=None) -> TrainState:
    """``TrainState`` of an ensemble: stacked parameters and stacked optimizer states
    (``train``: the trained parameters, see :func:`petfunc.train.trainable`)."""
    members = tree.unstack(params)
    states = [_single_init_state(p, optimizer, train) for p in members]
    return TrainState(params, tree.stack([s.opt_state for s in states]))


def member_state(state: TrainState, index: int) -> TrainState:
    """The single-model ``TrainState`` of member ``index`` (for checks and export)."""
    return tree.tree_map(lambda x: x[index], state)


# ---------------------------------------------------------------------------------------
# evaluation


def vmap_members(fn: Callable, n_shared: int = 3) -> Callable:
    """``vmap`` of ``fn(params, *data)`` over the member axis of ``params`` only.

    The data arguments (``n_shared`` of them, any pytrees) are shared by all members.
    Runs under :func:`~petfunc.compile.symbolic_vmap_rules`, so the result
    traces shape-generically with :func:`petfunc.compile`.
    """
    batched = vmap(fn, in_dims=(0,) + (None,) * n_shared)

    def wrapped(params, *data):
        with symbolic_vmap_rules():
            return batched(params, *data)

    return wrapped


def energy(energy_fn: Callable) -> Callable:
    """``fn(params, positions, cell, neighbors) -> [K, n_structures]``."""
    return vmap_members(energy_fn)


def energy_forces_stress(energy_fn: Callable) -> Callable:
    """``fn(params, positions, cell, neighbors) -> (energy [K, S], forces [K, N, 3],
    stress [K, S, 3, 3])``, one row per member (see
    :func:`petfunc.energy_forces_stress` for units and conventions)."""
    return vmap_members(_single_energy_forces_stress(energy_fn))


class Committee(NamedTuple):
    """Mean and spread of an ensemble's predictions (eV, eV/Å, eV/Å^3).

    ``*_std`` is the standard deviation over members (with ``correction`` 1 by
    default: the unbiased estimator); forces and stress have it per component.
    ``members`` holds the per-member ``(energy, forces, stress)``.
    """

    energy: torch.Tensor  # [n_structures]
    forces: torch.Tensor  # [n_atoms, 3]
    stress: torch.Tensor  # [n_structures, 3, 3]
    energy_std: torch.Tensor  # [n_structures]
    forces_std: torch.Tensor  # [n_atoms, 3]
    stress_std: torch.Tensor  # [n_structures, 3, 3]
    members: tuple


def committee(energy_fn: Callable, correction: int = 1) -> Callable:
    """``fn(params, positions, cell, neighbors) -> Committee`` (mean and std over members)."""
    members_fn = energy_forces_stress(energy_fn)

    def fn(params, positions, cell, neighbors):
        out = members_fn(params, positions, cell, neighbors)
        means = [x.mean(dim=0) for x in out]
        stds = [x.std(dim=0, correction=correction) for x in out]
        return Committee(*means, *stds, tuple(out))

    return fn


# ---------------------------------------------------------------------------------------
# training


def _member_batch_dims() -> Batch:
    # per-member geometry and labels, one shared neighbour graph
    return Batch(0, 0, None, 0, 0, 0)


def stack_batches(batches: Sequence[Batch]) -> Batch:
    """One batch per member, sharing their neighbour graph (e.g. rotated copies).

    Returns a :class:`~petfunc.data.Batch` whose positions, cell and labels have a
    leading member axis, for ``make_train_step(..., member_batches=True)``.

    Raises:
        ValueError: the batches do not share one neighbour graph.
    """
    batches = list(batches)
    first = batches[0].neighbors
    first_leaves, first_spec = tree.tree_flatten(first)
    for i, b in enumerate(batches[1:], start=1):
        leaves, spec = tree.tree_flatten(b.neighbors)
        same = [
            a is c is None or (a is not None and c is not None and torch.equal(a, c))
            for a, c in zip(first_leaves, leaves)
        ]
        if spec != first_spec or not all(same):
            raise ValueError(f"batch {i} has another neighbour graph than batch 0")
    fields = {
        name: torch.stack([getattr(b, name) for b in batches])
        for name in ("positions", "cell", "energy", "forces", "strain_derivative")
    }
    return Batch(neighbors=first, **fields)


def make_train_step(
    energy_fn,
    optimizer,
    weights: LossWeights = LossWeights(),
    grad_clip_norm: float | None = None,
    member_batches: bool = False,
    train=None,
):
    """``train_step(state, batch) -> (state, metrics)`` for K members at once.

    ``state`` is an ensemble :class:`~petfunc.TrainState` (:func:`init_state`); each
    member takes exactly the step :func:`petfunc.make_train_step` would take
    (gradient clipping per member, where asked), and every metric has a leading member axis.

    Args:
        energy_fn, optimizer, weights, grad_clip_norm: as for
            :func:`petfunc.make_train_step`.
        member_batches: ``False``: one batch shared by all members. ``True``: a
            batch from :func:`stack_batches` (positions, cell and labels per
            member, one neighbour graph).
        train: which parameters each member trains (:func:`petfunc.train.trainable`;
            e.g. ``petfunc.train.HEADS`` for a committee of readouts on a shared,
            fixed backbone); ``state`` must come from ``init_state(..., train)``.
    """
    step = _single_train_step(energy_fn, optimizer, weights, grad_clip_norm, train=train)
    batch_dims = _member_batch_dims() if member_batches else None
    batched = vmap(step, in_dims=(0, batch_dims))

    def train_step(state: TrainState, batch: Batch):
        with symbolic_vmap_rules():
            return batched(state, batch)

    return train_step
