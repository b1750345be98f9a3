""":func:`compile`, the entry point of :mod:`petfunc.compile`, and the checks that
other layers register for its example inputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from petfunc import allocator
from petfunc.compile.compiled import Compiled


_input_checks: list[Callable] = []


def register_input_check(check: Callable) -> Callable:
    """Have :func:`compile` call ``check(example_args, backend)`` before it traces;
    the check raises ``ValueError`` to refuse a compilation it knows to go wrong
    (:mod:`petfunc.model.long_range` refuses inductor for P3M inputs on GPUs of an
    old torch). Registering a check twice keeps one. Returns ``check``."""
    if check not in _input_checks:
        _input_checks.append(check)
    return check


def input_checks() -> tuple[Callable, ...]:
    """The checks :func:`register_input_check` registered, in order."""
    return tuple(_input_checks)


def compile(
    fn: Callable,
    *example_args,
    backend: Any = "inductor",
    options: dict | None = None,
    static_argnums=(0,),
    cache_key: str | None = None,
    keep_freed_memory: bool = True,
    aot_autograd: bool | None = None,
    donate_argnums=(),
    fused_attention: bool | None = None,
) -> Compiled:
    """Trace ``fn(*example_args)`` with ``make_fx`` and compile it (see
    :mod:`petfunc.compile`).

    Args:
        fn: a pure function of pytrees of tensors.
        example_args: arguments to trace with. Every size of every tensor must be at
            least 2 (build batches with :func:`petfunc.data.make_batch`, which pads).
        backend: ``torch.compile`` backend: ``"inductor"`` (fast code, slow to
            compile) or ``"aot_eager"`` (quick to compile, for tests).
        options: inductor config options (``torch._inductor.config`` names), set
            while the graph compiles; they take precedence over petfunc's own
            settings of inductor (:func:`patches`).
        static_argnums: arguments whose tensor sizes never change (parameters,
            optimizer state): they are traced with static sizes, which makes tracing
            and compiling much faster. All other tensors get symbolic sizes.
        cache_key: keep the trace in the trace cache under this key (see
            :mod:`petfunc.compile`); it must identify everything ``fn`` bakes into
            the trace.
        keep_freed_memory: when a tensor input is on the CPU, call
            :func:`petfunc.allocator.keep_freed_memory` (process-wide). A packed
            train state leaves the graph as a few model-sized buffers at every call;
            with glibc's defaults those are returned to the system when freed and
            page-faulted in again at the next step, which made the compiled step
            slower than a step on separate tensors instead of faster.
        aot_autograd: with inductor, compile through AOTAutograd as torch.compile
            does (its two re-traces of the graph; its cache makes a warm start a
            few seconds shorter) instead of one functionalizing re-trace (a shorter
            cold compile). Default: False, unless the environment sets
            ``PETFUNC_DIRECT_INDUCTOR=0``. The ASE calculators pass True: they are
            mostly started warm.
        donate_argnums: arguments (among ``static_argnums``) whose packed buffers
            the compiled function may overwrite with its outputs, as JAX's option
            of that name: a train step given ``donate_argnums=(0,)`` updates the
            parameters and optimizer moments of a state made by
            :func:`petfunc.init_state` in place, and the new state's tensors are
            views of the old state's buffers. The caller must not use the donated
            arguments after the call (they hold the new values, or a mix).
            ``petfunc train`` donates its state. Saves the Adam update a third of
            its memory traffic and the new state's memory.
        fused_attention: trace PET's attention as the CPU kernels of
            :mod:`petfunc.ops.fused_attention` (no ``[atoms, heads, t, t]`` grids in
            memory). Default: off, or on where the environment sets
            ``PETFUNC_FUSED_ATTENTION=1``. CPU inputs only.

    Returns:
        a callable with ``fn``'s signature; ``.num_graphs`` counts compilations.

    Raises:
        ValueError: a check of :func:`register_input_check` refuses the example.
    """
    for check in _input_checks:
        check(example_args, backend)
    if keep_freed_memory and any(
        isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in pytree.tree_leaves(example_args)
    ):
        allocator.keep_freed_memory()
    return Compiled(
        fn,
        example_args,
        backend=backend,
        options=options,
        static_argnums=static_argnums,
        cache_key=cache_key,
        aot_autograd=aot_autograd,
        donate_argnums=donate_argnums,
        fused_attention=fused_attention,
    )
