"""The step functions of a run: one training step ``step(state, batch) -> (state,
metrics)`` and the validation loss ``validate(params, batch) -> metrics``, eager or
compiled on their first batch.

The training step is one of three, chosen once by :func:`training_step` from the
run's :class:`~petfunc.trainer.processes.Processes`; the loop calls them alike:

- one process: the fused ``train_step(state, batch)`` (compiled: Adam updates the
  state in place);
- a ``reduce_grads`` hook: ``grads, metrics = grad_step(params, batch)``, the hook
  (e.g. an all-reduce average), then the optimizer step;
- several processes without the hook: :class:`petfunc.distributed.DataParallel`'s
  exact gradient step (global label counts, all-reduced inside), then the optimizer
  step.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence

from petfunc.compile import compile as compile_fn
from petfunc.distributed import DataParallel
from petfunc.remat import remat
from petfunc.train import LossWeights, TrainState, apply_gradients, make_grad_step, make_loss, make_train_step
from petfunc.trainer.metrics import floats
from petfunc.trainer.processes import Processes


class TrainStep:
    """One training step: ``step(state, batch) -> (state, metrics)``, the metrics as
    floats (``loss``, the per-term losses and error sums).

    Args:
        fn: the fused step ``(state, batch) -> (state, metrics)``, or, with
            ``apply``, the gradient step ``(params, batch) -> (grads, metrics)``.
        apply: ``(state, grads) -> state``, the reduction and the optimizer step of a
            gradient step. A step whose loss is not finite applies nothing (and
            exchanges nothing with other processes): the loop stops on its loss.
        compile: ``None`` (eager), or the keyword arguments of
            :func:`petfunc.compile` (``backend``, ``cache_key``): the step is traced
            on its first batch.
        log: where the compilation says what it does.
    """

    def __init__(self, fn, apply=None, compile: dict | None = None, log: Callable[[str], None] = print):
        self.raw = fn
        self.apply = apply
        self.compile_options = compile
        self.log = log
        self.fn = None  # the function called, built on the first batch

    def _build(self, state: TrainState, batch):
        if self.compile_options is None:
            return self.raw
        backend = self.compile_options["backend"]
        self.log(f"compiling the training step ({backend}); the first call takes a while ...")
        t0 = time.perf_counter()
        split = self.apply is not None
        # the fused step overwrites the state it is given (never used again; the
        # state owns its buffers, pack_state copied them): Adam updates in place
        compiled = compile_fn(
            self.raw,
            *((state.params, batch) if split else (state, batch)),
            donate_argnums=() if split else (0,),
            **self.compile_options,
        )
        done = "loaded the cached trace" if compiled.from_cache else "traced"
        self.log(f"{done} in {time.perf_counter() - t0:.1f} s")
        return compiled

    def __call__(self, state: TrainState, batch) -> tuple[TrainState, dict[str, float]]:
        if self.fn is None:
            self.fn = self._build(state, batch)
        if self.apply is None:
            state, metrics = self.fn(state, batch)
            return state, floats(metrics)
        grads, metrics = self.fn(state.params, batch)
        values = floats(metrics)
        if math.isfinite(values["loss"]):
            state = self.apply(state, grads)
        return state, values

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far (an ``AttributeError`` for an eager step, as
        :class:`petfunc.compile.Compiled` has the attribute and functions have not)."""
        return self.fn.num_graphs


class Validate:
    """The validation loss: ``validate(params, batch) -> metrics`` (floats), compiled
    on its first batch when ``compile`` gives :func:`petfunc.compile`'s keyword
    arguments."""

    def __init__(self, loss_fn, compile: dict | None = None):
        self.raw = loss_fn
        self.compile_options = compile
        self.fn = None

    def __call__(self, params, batch) -> dict[str, float]:
        if self.fn is None:
            self.fn = (
                self.raw
                if self.compile_options is None
                else compile_fn(self.raw, params, batch, **self.compile_options)
            )
        return floats(self.fn(params, batch)[1])

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far (an ``AttributeError`` when eager)."""
        return self.fn.num_graphs


def training_step(
    model,
    optimizer,
    weights: LossWeights,
    clip: float | None,
    train: Sequence[str] | None,
    processes: Processes,
    *,
    compile: bool,
    backend: str,
    rematerialise: bool,
    trace_key: str,
    first_step: int,
    log: Callable[[str], None],
) -> TrainStep:
    """The :class:`TrainStep` of ``model`` (a :class:`~petfunc.PET` or
    :class:`~petfunc.lora.LoRAPET`) for the run's ``processes`` (see the module
    docstring); ``train`` selects the trained parameters, ``clip`` is the gradient
    norm clip. Compiled steps are traced torch.func; eager ones use autograd, the
    same gradient 20-30 % faster (:mod:`petfunc.derivatives`). ``trace_key`` names
    everything the traced step bakes in (the trace cache key); ``first_step`` is
    the number of steps already taken (a restart), which errors name."""
    autodiff = "func" if compile else "autograd"
    if processes.split_step:
        raw = make_grad_step(model, weights, autodiff, train)
    else:
        raw = make_train_step(model, optimizer, weights, clip, autodiff, train)
    compile_options = {"backend": backend, "cache_key": f"fit step {trace_key}"} if compile else None
    reduce_grads = processes.reduce_grads or (lambda grads: grads)
    if processes.data_parallel:
        # compiles itself on the first batch
        raw = DataParallel(
            model,
            optimizer,
            weights,
            clip,
            compile=compile,
            backend=backend,
            metrics="share",
            train=train,
            cache_key=f"fit dp step {trace_key}",
            first_step=first_step,
        )
        compile_options = None
    if rematerialise:
        raw = remat(raw)
    if not processes.split_step:
        return TrainStep(raw, compile=compile_options, log=log)

    def apply(state: TrainState, grads) -> TrainState:
        return apply_gradients(optimizer, state, reduce_grads(grads), clip, train)[0]

    return TrainStep(raw, apply, compile_options, log)


def validation_loss(
    model,
    weights: LossWeights,
    terms: Sequence[str],
    val_terms: Sequence[str],
    *,
    compile: bool,
    backend: str,
    rematerialise: bool,
    trace_key: str,
    log: Callable[[str], None],
) -> Validate:
    """The :class:`Validate` of ``model``: the loss of ``weights`` (the active
    ``terms``), reporting every labelled quantity (``val_terms``), as metatrain does,
    also those whose loss weight is 0."""
    autodiff = "func" if compile else "autograd"
    loss_fn = make_loss(model, weights, autodiff)
    eval_loss_fn = (
        loss_fn
        if list(val_terms) == list(terms)
        else make_loss(model, weights, autodiff, metric_terms=val_terms)
    )
    if rematerialise:  # eager only (the options refuse it with compile); validation recomputed too
        eval_loss_fn = remat(eval_loss_fn)
        if weights.forces.weight or weights.stress.weight:
            log(
                "remat: the force and stress terms differentiate the recomputed layers again, "
                "which keeps their activations: expect little memory saved (it helps energy-only losses)"
            )
    compile_options = (
        {"backend": backend, "cache_key": f"fit loss {trace_key} {val_terms}"} if compile else None
    )
    return Validate(eval_loss_fn, compile_options)
