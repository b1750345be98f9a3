"""Optimizers as torchopt ``GradientTransformation`` s: metatrain's Adam(W) and
learning-rate schedule, and global-norm gradient clipping.

Each works on whole vectors where the trees are packed (one buffer per tree, see
:func:`petfunc.tree.pack`), and leaf by leaf otherwise, with the same numbers.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torchopt

from petfunc import tree


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


class AdamState(NamedTuple):
    """Step count (0-d int64) and first/second moment trees of :func:`adam`."""

    count: torch.Tensor
    mu: Any
    nu: Any


def weight_matrices(path: str, leaf) -> bool:
    """:func:`adamw`'s default weight-decay mask: the leaves of two or more
    dimensions (weight matrices, embeddings), not biases, norm weights or other
    1-d and 0-d leaves. Under ``vmap`` (ensembles) ``leaf.dim()`` is a member's."""
    return leaf.dim() >= 2


def decay_mask(mask, params) -> list[bool]:
    """Which leaves of ``params`` (in leaf order) ``mask`` decays: ``mask`` is a
    predicate ``(dotted path, leaf) -> bool`` or a tree of bools shaped like
    ``params`` (``None``: every leaf)."""
    if mask is None:
        return [True] * len(tree.tree_leaves(params))
    if callable(mask):
        return [bool(x) for x in tree.tree_leaves(tree.map_with_path(mask, params))]
    try:
        return [bool(x) for x in tree.tree_leaves(tree.tree_map(lambda _, m: m, params, mask))]
    except ValueError as error:
        raise ValueError(f"the weight-decay mask is not shaped like the parameters: {error}") from None


def adamw(
    learning_rate, weight_decay: float = 0.01, mask=weight_matrices, betas=(0.9, 0.999), eps: float = 1e-8
):
    """AdamW (``torch.optim.AdamW``'s update) with decay on the leaves ``mask`` selects.

    ``mask``: a predicate ``mask(path, leaf) -> bool`` of each leaf's dotted path
    (:func:`petfunc.tree.flatten`'s keys) and tensor, or a tree of bools of the
    parameters' structure; ``None`` decays every leaf (``torch.optim.AdamW`` on one
    parameter group). By default only weight matrices decay
    (:func:`weight_matrices`): no biases, no norm weights. It works on nested dicts,
    under ``vmap`` (ensembles) and :func:`petfunc.compile`: the mask is decided in
    Python from the parameters' paths and dimensions, never from their values. The
    numbers equal ``torch.optim.AdamW`` with two parameter groups, ``weight_decay``
    for the masked leaves and 0 for the others. See :func:`adam`.
    """
    if not weight_decay >= 0:
        raise ValueError(f"adamw: weight_decay must be >= 0, got {weight_decay!r}")
    return adam(learning_rate, betas=betas, eps=eps, weight_decay=float(weight_decay), mask=mask)


def adam(learning_rate, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay=None, mask=None):
    """Adam (AdamW with ``weight_decay``) as a torchopt ``GradientTransformation``.

    The update is ``torch.optim.Adam``'s (``AdamW``'s) to round-off, in the
    parameters' dtype, with the bias corrections in float64 (torchopt's own adam
    computes them in float32, ~1e-5 relative off). ``learning_rate`` is a float or a
    schedule of the step count; the first step uses ``schedule(0)``, as torch's
    ``LambdaLR`` does. ``mask`` selects the leaves that decay (see :func:`adamw`;
    ``None``: all of them).
    """
    b1, b2 = betas
    tree_map = tree.tree_map

    def init(params):
        leaves = tree.tree_leaves(params)
        device = leaves[0].device if leaves else None
        # each moment tree packed in one buffer: the update then runs on whole vectors
        mu, nu = (tree.pack(tree_map(torch.zeros_like, params)) for _ in range(2))
        return AdamState(torch.zeros((), dtype=torch.int64, device=device), mu, nu)

    def update(grads, state, params=None, inplace=False):
        del inplace  # always functional
        count = state.count + 1
        # no tensors made from Python floats here: a 0-d constant in a traced graph
        # becomes a symbolic float if the graph is handed to Dynamo (torch.compile),
        # which then restarts its analysis
        t = count.to(torch.float64)
        lr = learning_rate(state.count) if callable(learning_rate) else learning_rate * torch.ones_like(t)
        # b**t as exp(t log b), and the step factors computed once for all leaves.
        # Compiled, per-leaf pows of the step count would be inlined into every
        # leaf's update loop and evaluated again for each vector of elements;
        # inductor keeps a shared exp in a buffer of its own (the same numbers,
        # bitwise; a faster update and compile, see docs/performance.md).
        bias1 = 1.0 - torch.exp(t * math.log(b1))
        bias2_sqrt = torch.sqrt(1.0 - torch.exp(t * math.log(b2)))
        factors = {}

        def scalars(dtype):
            # (-lr / bias1, bias2_sqrt, lr * weight_decay or None) in the parameters' dtype
            if dtype not in factors:
                decay = None if weight_decay is None else (lr * weight_decay).to(dtype)
                factors[dtype] = ((-lr / bias1).to(dtype), bias2_sqrt.to(dtype), decay)
            return factors[dtype]

        first = functools.partial(_first_moment, b1=b1)
        second = functools.partial(_second_moment, b2=b2)

        # in-place operations on fresh temporaries only: on whole vectors, each
        # temporary is as large as the model (11 MB for the default PET)
        def step(m, v, p, decayed=True):
            step_size, b2_sqrt, decay = scalars(m.dtype)
            out = (step_size * m).div_(v.sqrt().div_(b2_sqrt).add_(eps))
            if decay is not None and decayed:
                out = out.sub_(decay * p)
            return out

        if weight_decay is not None and params is None:
            raise ValueError("AdamW needs params in update()")
        decayed = [params] if weight_decay is not None else []
        chosen = decay_mask(mask, params) if decayed else []
        # the packed pass decays every leaf: a mask that spares some goes leaf by leaf
        flat = _flat_leaves(grads, state.mu, state.nu, *decayed) if all(chosen) else None
        if flat is not None:
            # one pass over whole vectors (no copies when the trees are packed)
            (g, m, v, *p), spec, shapes = flat
            m, v = first(m, g), second(v, g)
            p = p[0] if p else None
            rebuild = functools.partial(_unravel_tree, spec=spec, shapes=shapes)
            return rebuild(step(m, v, p)), AdamState(count, rebuild(m), rebuild(v))
        # mixed dtypes or devices: leaf by leaf
        mu = tree_map(first, state.mu, grads)
        nu = tree_map(second, state.nu, grads)
        if not decayed:
            return tree_map(step, mu, nu, mu), AdamState(count, mu, nu)
        leaves, spec = tree.tree_flatten(mu)
        steps = map(step, leaves, tree.tree_leaves(nu), tree.tree_leaves(params), chosen)
        return tree.tree_unflatten(list(steps), spec), AdamState(count, mu, nu)

    return torchopt.base.GradientTransformation(init, update)


def _first_moment(m, g, b1):
    """Adam's first moment after the gradient ``g``."""
    return torch.lerp(m, g, 1.0 - b1)


def _second_moment(v, g, b2):
    """Adam's second moment after the gradient ``g``. Out of place: vmap (ensembles)
    has no batching rule for ``addcmul_`` and would run it member by member."""
    return torch.addcmul(v * b2, g, g, value=1.0 - b2)


def _flat_leaves(*trees):
    """``([ravel(leaves of each tree)], spec, shapes)`` when the trees have one
    structure and all their leaves one dtype and device, else ``None``."""
    flattened = [tree.tree_flatten(t) for t in trees]
    leaves, spec = flattened[0]
    if not leaves or any(s != spec for _, s in flattened[1:]):
        return None
    shapes = [leaf.shape for leaf in leaves]
    kinds = {(leaf.dtype, leaf.device) for ls, _ in flattened for leaf in ls}
    if len(kinds) != 1 or any([x.shape for x in ls] != shapes for ls, _ in flattened[1:]):
        return None
    return [tree.ravel(ls) for ls, _ in flattened], spec, shapes


def _unravel_tree(flat, spec, shapes):
    return tree.tree_unflatten(tree.unravel(flat, shapes), spec)


def apply_updates(params, updates):
    """``params + updates`` leaf by leaf (torchopt's ``apply_updates``, functional),
    as one vector operation when all leaves share dtype and device."""
    flat = _flat_leaves(params, updates)
    if flat is None:
        return torchopt.apply_updates(params, updates, inplace=False)
    (p, u), spec, shapes = flat
    return _unravel_tree(p + u, spec, shapes)


def make_optimizer(schedule, weight_decay=None):
    """metatrain's optimizer: Adam, or AdamW when ``weight_decay`` is a float."""
    return adam(schedule, betas=(0.9, 0.999), eps=1e-8, weight_decay=weight_decay)


def clip_by_global_norm(grads, max_norm: float):
    """Scale a gradient tree so its global 2-norm is at most ``max_norm``.

    Same formula as ``torch.nn.utils.clip_grad_norm_``: factor
    ``min(1, max_norm / (norm + 1e-6))``. Returns ``(clipped, norm)``.
    """
    flat = _flat_leaves(grads)
    if flat is not None:
        # one vector: one reduction and one scaling pass (the clipped gradient is
        # packed, so the optimizer reads it without a copy)
        (g,), spec, shapes = flat
        norm = torch.linalg.vector_norm(g)
    else:
        leaves = tree.tree_leaves(grads)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in leaves]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if flat is not None:
        return _unravel_tree(g * factor.to(g.dtype), spec, shapes), norm
    return tree.tree_map(lambda x: x * factor.to(x.dtype), grads), norm
