"""A pure training step: ``state, metrics = train_step(state, batch)``.

The step computes the parameter gradient of :func:`petfunc.train.loss.make_loss`'s loss
with ``torch.func.grad`` (a grad of the grad that gives forces and stress), clips
its global norm as ``torch.nn.utils.clip_grad_norm_`` does, and applies a torchopt
optimizer functionally. Composition weights and the energy scale are fitted, not
trained: they stay out of the gradient and the optimizer. ``train=`` (path prefixes,
see :func:`trainable`) restricts training to part of the weights, for fine-tuning.

Clipping, the Adam update and adding the update work on whole vectors: the
gradient is concatenated once, and the parameters and moments of a state from
:func:`init_state` (or :func:`pack_state`) are views of one buffer each, so they
need no copy and come back packed the same way. Compiled, that is a few fused
kernels instead of a few per parameter tensor (115 of them in the default PET),
which took 40 % of the training step's compile time.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch
import torchopt
from torch.func import grad_and_value
from torch.utils._pytree import tree_flatten, tree_unflatten

from petfunc import tree
from petfunc.derivatives import _assert_eager, _check_autodiff
from petfunc.train.loss import LossWeights, make_loss


FROZEN = ("composition_weights", "energy_scale")


class TrainState(NamedTuple):
    """Parameters (including the frozen composition and scale) and optimizer state."""

    params: Any
    opt_state: Any


# metatrain's default selection for ``finetune: {method: heads}``
HEADS = ("node_heads", "edge_heads", "node_last_layers", "edge_last_layers")


def trainable(params, train: Sequence[str] | None = None):
    """The trained part of a PET parameter tree.

    ``train=None``: everything but the composition weights and the energy scale, as a
    tree of the same nesting. ``train``: a sequence of dotted-path prefixes (for
    example :data:`HEADS`, metatrain's ``finetune: {method: heads}``); the trained
    part is then a flat ``{dotted.path: tensor}`` dict of the parameters whose path
    starts with one of them (string prefixes, as metatrain matches module names),
    and everything else is held fixed. Raises ``ValueError`` when nothing matches.
    """
    if train is None:
        return {k: v for k, v in params.items() if k not in FROZEN}
    if isinstance(train, str):
        raise TypeError("train must be a sequence of path prefixes, not one string")
    selected = {
        path: value
        for path, value in tree.flatten(params).items()
        if path.split(".")[0] not in FROZEN and any(path.startswith(prefix) for prefix in train)
    }
    if not selected:
        top = sorted({p.split(".")[0] for p in tree.flatten(params)} - set(FROZEN))
        raise ValueError(
            f"no parameter path starts with any of {list(train)}; the parameters are under {top}"
        )
    return selected


def with_trained(params, trained, train: Sequence[str] | None = None):
    """``params`` with its trained part (as :func:`trainable` cuts it) replaced by
    ``trained``."""
    if train is None:
        return {**trained, **{k: params[k] for k in FROZEN if k in params}}
    return tree.unflatten({**tree.flatten(params), **trained})


def init_state(params, optimizer, train: Sequence[str] | None = None) -> TrainState:
    """``TrainState(params, optimizer.init(trainable(params, train)))``, packed
    (:func:`pack_state`)."""
    return pack_state(TrainState(params, optimizer.init(trainable(params, train))), train)


def pack_state(state: TrainState, train: Sequence[str] | None = None) -> TrainState:
    """``state`` with its trained parameters (:func:`pack_params`) and each part of
    the optimizer state shaped like them (Adam's moments, ...) copied into one
    buffer each (a part already in one buffer is kept). Same values; use it on a
    state assembled by hand or loaded from a file, before :func:`petfunc.compile`
    traces the step with it (the compiled step takes the layout of its example)."""
    shapes = [leaf.shape for leaf in tree_flatten(trainable(state.params, train))[0]]

    def shaped_like_params(node):
        # a part with the parameters' shapes, in order (torchopt keeps lists of leaves)
        leaves = tree_flatten(node)[0]
        return bool(leaves) and [getattr(leaf, "shape", None) for leaf in leaves] == shapes

    def packed(node):
        # a part packed already (petfunc's adam packs its fresh moments) is kept
        leaves = tree_flatten(node)[0]
        return node if tree._packed_range(leaves) is not None else tree.pack(node)

    opt_state = torch.utils._pytree.tree_map(
        lambda node: packed(node) if shaped_like_params(node) else node,
        state.opt_state,
        is_leaf=shaped_like_params,
    )
    return TrainState(pack_params(state.params, train), opt_state)


def pack_params(params, train: Sequence[str] | None = None):
    """``params`` with the trained part (:func:`trainable`) copied into one flat
    buffer, its tensors views of it (:func:`petfunc.tree.pack`).

    Same values. The training step then clips, updates and applies whole vectors
    without copying the parameters first, and its new parameters come out packed
    the same way. Training works on unpacked parameters too, a little slower.
    """
    return with_trained(params, tree.pack(trainable(params, train)), train)


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


def adam(learning_rate, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay=None):
    """Adam (AdamW with ``weight_decay``) as a torchopt ``GradientTransformation``.

    The update is ``torch.optim.Adam``'s (``AdamW``'s) to round-off, in the
    parameters' dtype, with the bias corrections in float64 (torchopt's own adam
    computes them in float32, ~1e-5 relative off). ``learning_rate`` is a float or a
    schedule of the step count; the first step uses ``schedule(0)``, as torch's
    ``LambdaLR`` does.
    """
    b1, b2 = betas
    tree_map = torch.utils._pytree.tree_map

    def init(params):
        leaves = torch.utils._pytree.tree_leaves(params)
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
        # Compiled, per-leaf pows of the step count are inlined into every leaf's
        # update loop and evaluated again for each vector of elements; inductor
        # keeps a shared exp in a buffer of its own. Measured for 2.9M parameters
        # (bitwise the same result): update 24.7 -> 20.2 ms, compile 65 -> 49 s.
        bias1 = 1.0 - torch.exp(t * math.log(b1))
        bias2_sqrt = torch.sqrt(1.0 - torch.exp(t * math.log(b2)))
        factors = {}

        def scalars(dtype):
            # (-lr / bias1, bias2_sqrt, lr * weight_decay or None) in the parameters' dtype
            if dtype not in factors:
                decay = None if weight_decay is None else (lr * weight_decay).to(dtype)
                factors[dtype] = ((-lr / bias1).to(dtype), bias2_sqrt.to(dtype), decay)
            return factors[dtype]

        def first(m, g):
            return torch.lerp(m, g, 1.0 - b1)

        # in-place operations on fresh temporaries only: on whole vectors, each
        # temporary is as large as the model (11 MB for the default PET).
        # addcmul out of place: vmap (ensembles) has no batching rule for addcmul_
        # and would run it member by member (the same kernel, the same numbers)
        def second(v, g):
            return torch.addcmul(v * b2, g, g, value=1.0 - b2)

        def step(m, v, p):
            step_size, b2_sqrt, decay = scalars(m.dtype)
            out = (step_size * m).div_(v.sqrt().div_(b2_sqrt).add_(eps))
            if decay is not None:
                out = out.sub_(decay * p)
            return out

        if weight_decay is not None and params is None:
            raise ValueError("AdamW needs params in update()")
        decayed = [params] if weight_decay is not None else []
        flat = _flat_leaves(grads, state.mu, state.nu, *decayed)
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
        updates = tree_map(step, mu, nu, params if params is not None else mu)
        return updates, AdamState(count, mu, nu)

    return torchopt.base.GradientTransformation(init, update)


def _flat_leaves(*trees):
    """``([ravel(leaves of each tree)], spec, shapes)`` when the trees have one
    structure and all their leaves one dtype and device, else ``None``."""
    flattened = [tree_flatten(t) for t in trees]
    leaves, spec = flattened[0]
    if not leaves or any(s != spec for _, s in flattened[1:]):
        return None
    shapes = [leaf.shape for leaf in leaves]
    kinds = {(leaf.dtype, leaf.device) for ls, _ in flattened for leaf in ls}
    if len(kinds) != 1 or any([x.shape for x in ls] != shapes for ls, _ in flattened[1:]):
        return None
    return [tree.ravel(ls) for ls, _ in flattened], spec, shapes


def _unravel_tree(flat, spec, shapes):
    return tree_unflatten(tree.unravel(flat, shapes), spec)


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
        leaves = torch.utils._pytree.tree_leaves(grads)
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in leaves]))
    factor = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    if flat is not None:
        return _unravel_tree(g * factor.to(g.dtype), spec, shapes), norm
    return torch.utils._pytree.tree_map(lambda x: x * factor.to(x.dtype), grads), norm


def make_grad_step(
    energy_fn,
    weights: LossWeights = LossWeights(),
    autodiff: str = "func",
    train: Sequence[str] | None = None,
):
    """``grad_step(params, batch) -> (grads, metrics)`` of the trainable parameters.

    Gradients are plain outputs, so data-parallel training can all-reduce them
    between this step and :func:`apply_gradients`.

    ``autodiff="func"`` (default): ``torch.func`` for the forces and for the
    parameter gradient (a grad of a grad), traceable by :func:`petfunc.compile`.
    ``autodiff="autograd"``: the same gradient by ``torch.autograd.grad`` with
    ``create_graph=True`` for the forces, eagerly only; 20-30 % faster than eager
    ``"func"`` on CPU (see :mod:`petfunc.derivatives`).
    ``train``: which parameters get gradients (:func:`trainable`).
    """
    return grad_step_of(make_loss(energy_fn, weights, autodiff), autodiff, train)


def value_and_grad(objective, train_params, autodiff: str = "func"):
    """``(grads, aux)`` of ``objective(train_params) -> (scalar, aux)`` with respect to
    every tensor of the ``train_params`` tree (zeros for those the scalar does not
    depend on); ``aux`` comes back detached."""
    _check_autodiff(autodiff)
    if autodiff == "func":
        grads, (_, aux) = grad_and_value(objective, has_aux=True)(train_params)
        return grads, aux
    _assert_eager("the parameter gradient")
    leaves, spec = tree_flatten(train_params)
    variables = [leaf.detach().requires_grad_(True) for leaf in leaves]
    with torch.enable_grad():
        value, aux = objective(tree_unflatten(variables, spec))
        grads = torch.autograd.grad(value, variables, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for v, g in zip(variables, grads)]
    aux = torch.utils._pytree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
    return tree_unflatten(grads, spec), aux


def grad_step_of(loss_fn, autodiff: str = "func", train: Sequence[str] | None = None):
    """``grad_step(params, batch) -> (grads, metrics)`` of any ``loss_fn(params, batch)
    -> (loss, metrics)``: the gradient of the trainable parameters (``trainable(params,
    train)``; the rest, composition and scale included, held fixed), by
    :func:`value_and_grad`."""
    _check_autodiff(autodiff)

    def grad_step(params, batch):
        def objective(train_params):
            return loss_fn(with_trained(params, train_params, train), batch)

        return value_and_grad(objective, trainable(params, train), autodiff)

    return grad_step


def train_step_of(grad_step, optimizer, grad_clip_norm: float = 1.0, train: Sequence[str] | None = None):
    """``train_step(state, batch) -> (state, metrics)`` from a ``grad_step``: clipping
    and the optimizer update of :func:`apply_gradients`, with the gradient norm added
    to the metrics when clipping. ``train`` must be the grad step's selection."""

    def train_step(state: TrainState, batch):
        grads, metrics = grad_step(state.params, batch)
        state, norm = apply_gradients(optimizer, state, grads, grad_clip_norm, train)
        if norm is not None:
            metrics = {**metrics, "grad_norm": norm}
        return state, metrics

    return train_step


def apply_gradients(
    optimizer, state: TrainState, grads, grad_clip_norm: float = 1.0, train: Sequence[str] | None = None
):
    """Clip ``grads`` (of ``trainable(params, train)``) and take one optimizer step:
    ``(new_state, grad_norm)``. The norm is that of the trained parameters only, as
    ``clip_grad_norm_`` skips metatrain's frozen ones."""
    norm = None
    if grad_clip_norm is not None and math.isfinite(grad_clip_norm):
        grads, norm = clip_by_global_norm(grads, grad_clip_norm)
    params = state.params
    train_params = trainable(params, train)
    try:
        updates, opt_state = optimizer.update(grads, state.opt_state, params=train_params, inplace=False)
    except (ValueError, RuntimeError) as error:  # optree's "Node arity mismatch", size mismatches
        if _made_for(state.opt_state, params) and not _made_for(state.opt_state, train_params):
            raise ValueError(
                "the optimizer state was made for every parameter, composition_weights and energy_scale "
                "included, which are not trained (metatrain fits them on the data): make it with "
                "petfunc.init_state(params, optimizer), or optimizer.init(petfunc.train.trainable(params))"
            ) from None
        if isinstance(error, RuntimeError) or ("arity" not in str(error) and "structure" not in str(error)):
            raise
        raise ValueError(
            f"the optimizer state does not fit the trained parameters (train={train!r}): make the "
            f"state with init_state(params, optimizer, train=...) with the step's own train= ({error})"
        ) from None
    new_params = apply_updates(train_params, updates)
    return TrainState(with_trained(params, new_params, train), opt_state), norm


def _made_for(opt_state, params) -> bool:
    """Whether a part of ``opt_state`` (Adam's moments, say) has the leaves of ``params``."""
    # as sorted lists of shapes: optimizers may order the leaves another way (torchopt
    # sorts dict keys)
    shapes = sorted(tuple(leaf.shape) for leaf in tree_flatten(params)[0])
    parts = list(opt_state) if isinstance(opt_state, (tuple, list)) else [opt_state]
    for part in parts:
        fields = list(part) if isinstance(part, tuple) else [part]
        for field in fields:
            leaves = tree_flatten(field)[0]
            if leaves and sorted(tuple(getattr(leaf, "shape", ())) for leaf in leaves) == shapes:
                return True
    return False


def make_train_step(
    energy_fn,
    optimizer,
    weights: LossWeights = LossWeights(),
    grad_clip_norm: float = 1.0,
    autodiff: str = "func",
    train: Sequence[str] | None = None,
):
    """``train_step(state, batch) -> (state, metrics)``, a pure function.

    Args:
        energy_fn: a :class:`~petfunc.PET` (its training-mode ``raw_energy`` is used)
            or an energy function in the batch's training units.
        optimizer: any torchopt ``GradientTransformation`` (schedules inside it).
        weights: the loss terms.
        grad_clip_norm: maximal global gradient norm (``None`` or ``inf``: no clipping).
        autodiff: ``"func"`` (traceable, for :func:`petfunc.compile`) or ``"autograd"``
            (eager only, faster eagerly); see :func:`make_grad_step`.
        train: which parameters are trained (:func:`trainable`): ``None`` for all
            but composition and scale, or path prefixes such as :data:`HEADS`
            (fine-tuning the readout only); the others stay exactly as they are.
            The state must come from ``init_state(params, optimizer, train)``.
    """
    return train_step_of(
        make_grad_step(energy_fn, weights, autodiff, train), optimizer, grad_clip_norm, train
    )
