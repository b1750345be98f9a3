"""Pure training steps: ``state, metrics = train_step(state, batch)``.

The step computes the parameter gradient of :func:`petfunc.train.loss.make_loss`'s
loss (or of any ``loss_fn(params, batch) -> (loss, metrics)``) with
``torch.func.grad`` (a grad of the grad that gives forces and stress), clips its
global norm as ``torch.nn.utils.clip_grad_norm_`` does where asked
(``grad_clip_norm``; ``petfunc train`` asks for metatrain's), and applies an
optimizer functionally: any object with ``init(params)`` and ``update(grads, state,
...)`` (a torchopt or optax-like ``GradientTransformation``, :mod:`petfunc.train.optim`).
A gradient step (:func:`make_grad_step`) returns the gradients as plain outputs
instead, for data parallelism to all-reduce them before :func:`apply_gradients`.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping

import torch
from torch.func import grad_and_value

from petfunc import tree
from petfunc.compile import register_input_check
from petfunc.derivatives import assert_eager, check_autodiff
from petfunc.train.loss import LossWeights, make_loss
from petfunc.train.optim import apply_updates, clip_by_global_norm
from petfunc.train.state import FROZEN, Train, TrainState, trainable, with_trained


#: why an optimizer state made by ``optimizer.init(params)`` does not fit a step
STATE_OF_EVERY_PARAMETER = (
    "the optimizer state was made for every parameter, composition_weights and energy_scale "
    "included, which are not trained (metatrain fits them on the data): make it with "
    "petfunc.init_state(params, optimizer), or optimizer.init(petfunc.train.trainable(params))"
)


def make_grad_step(
    energy_fn=None,
    weights: LossWeights = LossWeights(),
    autodiff: str = "func",
    train: Train = None,
    *,
    loss_fn: Callable | None = None,
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
    ``loss_fn``: any ``loss_fn(params, batch) -> (loss, metrics)`` in place of
    ``energy_fn`` and ``weights`` (see :func:`make_train_step`).
    """
    return grad_step_of(loss_of(energy_fn, weights, autodiff, loss_fn), autodiff, train)


def loss_of(energy_fn, weights: LossWeights, autodiff: str, loss_fn: Callable | None) -> Callable:
    """The loss a step differentiates: ``loss_fn`` as it is, or
    :func:`make_loss` of ``energy_fn`` and ``weights``; exactly one of the two."""
    if loss_fn is None:
        if energy_fn is None:
            raise TypeError("a train step needs an energy function (a PET) or loss_fn=")
        return make_loss(energy_fn, weights, autodiff)
    if energy_fn is not None:
        raise TypeError(
            "a train step takes an energy function (with weights=) or loss_fn=, not both: "
            "a loss_fn computes its own energies"
        )
    if weights != LossWeights():
        raise TypeError("weights= applies to petfunc's own loss; a loss_fn= weighs its terms itself")
    if not callable(loss_fn):
        raise TypeError(f"loss_fn must be a function (params, batch) -> (loss, metrics), got {loss_fn!r}")
    return loss_fn


def value_and_grad(objective, train_params, autodiff: str = "func"):
    """``(grads, aux)`` of ``objective(train_params) -> (scalar, aux)`` with respect to
    every tensor of the ``train_params`` tree (zeros for those the scalar does not
    depend on); ``aux`` comes back detached."""
    check_autodiff(autodiff)
    if autodiff == "func":
        grads, (_, aux) = grad_and_value(objective, has_aux=True)(train_params)
        return grads, aux
    assert_eager("the parameter gradient")
    leaves, spec = tree.tree_flatten(train_params)
    variables = [leaf.detach().requires_grad_(True) for leaf in leaves]
    with torch.enable_grad():
        value, aux = objective(tree.tree_unflatten(variables, spec))
        grads = torch.autograd.grad(value, variables, allow_unused=True)
    grads = [torch.zeros_like(v) if g is None else g for v, g in zip(variables, grads)]
    aux = tree.tree_map(lambda t: t.detach() if isinstance(t, torch.Tensor) else t, aux)
    return tree.tree_unflatten(grads, spec), aux


def grad_step_of(loss_fn, autodiff: str = "func", train: Train = None):
    """``grad_step(params, batch) -> (grads, metrics)`` of any ``loss_fn(params, batch)
    -> (loss, metrics)``: the gradient of the trainable parameters (``trainable(params,
    train)``; the rest, composition and scale included, held fixed), by
    :func:`value_and_grad`."""
    check_autodiff(autodiff)

    def grad_step(params, batch):
        def objective(train_params):
            return loss_fn(with_trained(params, train_params, train), batch)

        return value_and_grad(objective, trainable(params, train), autodiff)

    return grad_step


def train_step_of(grad_step, optimizer, grad_clip_norm: float | None = None, train: Train = None):
    """``train_step(state, batch) -> (state, metrics)`` from a ``grad_step``: clipping
    (only with a ``grad_clip_norm``) and the optimizer update of
    :func:`apply_gradients`, with the gradient norm added to the metrics when
    clipping. ``train`` must be the grad step's selection."""

    def train_step(state: TrainState, batch):
        grads, metrics = grad_step(state.params, batch)
        state, norm = apply_gradients(optimizer, state, grads, grad_clip_norm, train)
        if norm is not None:
            metrics = {**metrics, "grad_norm": norm}
        return state, metrics

    return train_step


def apply_gradients(
    optimizer, state: TrainState, grads, grad_clip_norm: float | None = None, train: Train = None
):
    """Clip ``grads`` (of ``trainable(params, train)``) when ``grad_clip_norm`` is a
    number, and take one optimizer step: ``(new_state, grad_norm)`` (``grad_norm``
    ``None`` unclipped). The norm is that of the trained parameters only, as
    ``clip_grad_norm_`` skips metatrain's frozen ones. ``optimizer.update`` gets
    ``params=`` and ``inplace=False`` where its signature takes them."""
    norm = None
    if grad_clip_norm is not None and math.isfinite(grad_clip_norm):
        grads, norm = clip_by_global_norm(grads, grad_clip_norm)
    params = state.params
    train_params = trainable(params, train)
    options = update_options(optimizer, params=train_params, inplace=False)
    try:
        updates, opt_state = optimizer.update(grads, state.opt_state, **options)
    except (ValueError, RuntimeError) as error:  # optree's "Node arity mismatch", size mismatches
        if made_for_every_parameter(state):
            raise ValueError(STATE_OF_EVERY_PARAMETER) from None
        mismatch = ("arity", "structure", "trees differ")  # optree's, torch's and petfunc.tree's words
        if isinstance(error, RuntimeError) or not any(word in str(error) for word in mismatch):
            raise
        raise ValueError(
            f"the optimizer state does not fit the trained parameters (train={train!r}): make the "
            f"state with init_state(params, optimizer, train=...) with the step's own train= ({error})"
        ) from None
    new_params = apply_updates(train_params, updates)
    return TrainState(with_trained(params, new_params, train), opt_state), norm


def update_options(optimizer, **options) -> dict:
    """The keyword ``options`` that ``optimizer.update`` accepts (all of them when it
    takes ``**kwargs``): torchopt's ``update(updates, state, *, params=None,
    inplace=True)``, optax's ``update(updates, state, params=None)``, a hand-written
    ``update(grads, state)``."""
    try:
        signature = inspect.signature(optimizer.update)
    except AttributeError:
        raise TypeError(
            f"the optimizer must have init(params) and update(grads, state, ...) (a GradientTransformation), "
            f"got {type(optimizer).__name__}"
        ) from None
    except (TypeError, ValueError):  # a builtin without a signature: pass nothing optional
        return {}
    parameters = signature.parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters):
        return options
    accepted = {
        p.name
        for p in parameters
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }
    return {name: value for name, value in options.items() if name in accepted}


def made_for_every_parameter(state: TrainState) -> bool:
    """Whether ``state``'s optimizer state was made for the whole parameter tree, the
    fitted composition weights and energy scale included (``optimizer.init(params)``),
    which no step trains."""
    params = state.params
    if not isinstance(params, Mapping) or not any(key in params for key in FROZEN):
        return False
    return _made_for(state.opt_state, params) and not _made_for(state.opt_state, trainable(params))


def refuse_state_of_every_parameter(example_args, backend=None) -> None:
    """:func:`petfunc.compile`'s check of its example arguments: raise ``ValueError``
    for a :class:`TrainState` whose optimizer state :func:`made_for_every_parameter`,
    before tracing a step with it (the trace would stop at the optimizer update, after
    torch has logged the failed operation)."""
    for arg in example_args:
        if isinstance(arg, TrainState) and made_for_every_parameter(arg):
            raise ValueError(f"petfunc.compile: {STATE_OF_EVERY_PARAMETER}")


register_input_check(refuse_state_of_every_parameter)


def _made_for(opt_state, params) -> bool:
    """Whether a part of ``opt_state`` (Adam's moments, say) has the leaves of ``params``."""
    # as sorted lists of shapes: optimizers may order the leaves another way (torchopt
    # sorts dict keys)
    shapes = sorted(tuple(leaf.shape) for leaf in tree.tree_flatten(params)[0])
    parts = list(opt_state) if isinstance(opt_state, (tuple, list)) else [opt_state]
    for part in parts:
        fields = list(part) if isinstance(part, tuple) else [part]
        for field in fields:
            leaves = tree.tree_flatten(field)[0]
            if leaves and sorted(tuple(getattr(leaf, "shape", ())) for leaf in leaves) == shapes:
                return True
    return False


def make_train_step(
    energy_fn=None,
    optimizer=None,
    weights: LossWeights = LossWeights(),
    grad_clip_norm: float | None = None,
    autodiff: str = "func",
    train: Train = None,
    *,
    loss_fn: Callable | None = None,
):
    """``train_step(state, batch) -> (state, metrics)``, a pure function.

    Args:
        energy_fn: a :class:`~petfunc.PET` (its training-mode ``raw_energy`` is used)
            or an energy function in the batch's training units.
        optimizer: a ``GradientTransformation``: any object with ``init(params)`` and
            ``update(grads, state, ...)`` returning ``(updates, state)`` (torchopt's,
            :func:`petfunc.train.adamw`, optax-like ones; schedules inside it).
        weights: the loss terms.
        grad_clip_norm: maximal global gradient norm. ``None`` (default) or ``inf``:
            no clipping, so an optimizer that clips itself is not clipped twice;
            ``petfunc train`` passes metatrain's ``grad_clip_norm`` (1.0).
        autodiff: ``"func"`` (traceable, for :func:`petfunc.compile`) or ``"autograd"``
            (eager only, faster eagerly); see :func:`make_grad_step`.
        train: which parameters are trained (:func:`trainable`): ``None`` for all
            but composition and scale, path prefixes such as :data:`HEADS`
            (fine-tuning the readout only) or a predicate ``(path, leaf) -> bool``;
            the others stay exactly as they are. The state must come from
            ``init_state(params, optimizer, train)``.
        loss_fn: any ``loss_fn(params, batch) -> (loss, metrics)`` (``loss`` a 0-d
            tensor, ``metrics`` a dict of tensors), in place of ``energy_fn`` and
            ``weights``; ``params`` is the whole tree, the frozen part included.

    Example, a loss of one's own (docs/training.md)::

        def loss_fn(params, batch):
            energies = model.raw_energy(params, batch.positions, batch.cell, batch.neighbors)
            loss = ((energies - batch.energy) ** 2).mean()
            return loss, {"loss": loss}

        optimizer = petfunc.train.adamw(1e-3, weight_decay=0.01)
        step = petfunc.make_train_step(optimizer=optimizer, loss_fn=loss_fn)
        state, metrics = step(petfunc.init_state(params, optimizer), batch)
    """
    if optimizer is None:
        raise TypeError("make_train_step needs an optimizer (a GradientTransformation with init and update)")
    grad_step = make_grad_step(energy_fn, weights, autodiff, train, loss_fn=loss_fn)
    return train_step_of(grad_step, optimizer, grad_clip_norm, train)
