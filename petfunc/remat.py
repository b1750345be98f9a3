"""Rematerialisation: PET's transformer layers recomputed in the backward pass.

Forces and stress are a backward pass through the whole network, which needs the
activations of every layer. For the default PET these are megabytes per atom, and
they set the memory of large systems. Inside a function wrapped by :func:`remat`, each
transformer layer keeps only its inputs for the backward pass and computes its
internals again when the backward pass reaches it (``torch.utils.checkpoint``,
non-reentrant). The derivatives are the same, bit for bit (the same operations
run on the same inputs); the price is one more forward pass of the transformer
layers. The activations kept for the backward pass, and so the peak memory of a
large cell, fall several times (``benchmarks/memory.py``, see docs/performance.md).
Other memory (one layer's recomputed internals, gradients, the neighbour list) is
not reduced.

Works with ``torch.autograd`` (``autodiff="autograd"``, eager), double backward
included. A double backward (a force or stress loss differentiated for its
parameter gradient) saves little, though: the first backward pass builds a graph
for the second, and that graph keeps the recomputed activations (an energy-only
training step saves much more). ``torch.func`` transforms refuse the saved-tensor hooks that
``torch.utils.checkpoint`` relies on, so inside them, under ``make_fx``
(:func:`petfunc.compile`, ``petfunc export``) and under ``torch.compile``,
rematerialisation raises a ``RuntimeError`` instead of running.

    >>> fn = energy_terms_forces_strain_derivative(remat(model.energy_terms), "autograd")
"""

from __future__ import annotations

import contextvars
import functools

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils.checkpoint import checkpoint


_ACTIVE = contextvars.ContextVar("petfunc_remat", default=False)


def remat(fn):
    """``fn`` with its PET transformer layers rematerialised (same signature and values)."""

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        token = _ACTIVE.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _ACTIVE.reset(token)

    return wrapped


def active() -> bool:
    """Whether the current call runs inside a :func:`remat` function."""
    return _ACTIVE.get()


def call(layer, *args):
    """``layer(*args)``, checkpointed inside :func:`remat` when autograd records.

    Without grad mode there is no backward pass to save activations for, so the
    layer runs as is.
    """
    if not _ACTIVE.get() or not torch.is_grad_enabled():
        return layer(*args)
    if (
        torch._C._functorch.peek_interpreter_stack() is not None
        or get_proxy_mode() is not None
        or torch.compiler.is_compiling()
    ):
        raise RuntimeError(
            "petfunc.remat recomputes layers with torch.utils.checkpoint, which runs with "
            "torch.autograd only (autodiff='autograd', eager): torch.func transforms, make_fx "
            "(petfunc.compile, petfunc export) and torch.compile do not support it"
        )
    # PET layers draw no random numbers: no RNG state to stash and restore
    return checkpoint(layer, *args, use_reentrant=False, preserve_rng_state=False)


def saved_tensor_bytes(fn, *args, **kwargs):
    """``(fn(*args, **kwargs), n_bytes)``: the result, and the bytes of the distinct
    storages autograd saved for backward passes while ``fn`` ran: the activation
    memory :func:`remat` reduces. Exact (a saved-tensor hook), not timed; storages
    saved several times count once."""
    saved = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = fn(*args, **kwargs)
    return out, sum(saved.values())
