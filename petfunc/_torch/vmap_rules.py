"""vmap batching rules that keep symbolic sizes symbolic (for tracing ensembles).

Some of PyTorch's C++ batching rules read a tensor's sizes as plain integers
(``cat``, ``scatter_add``, ``gather``, ``slice_backward``, the layer-norm pair, and
in torch 2.11-2.12 ``mm`` and ``bmm``, whose rules call ``matmul`` on the physical tensors).
Under ``make_fx`` with symbolic sizes that read turns every size of the tensor into
a constant of the trace: the traced ensemble then only works for the batch it was
traced with (``expand: attempting to expand a dimension of length 148 -> 81``).
:func:`symbolic_vmap_rules` temporarily replaces those rules by Python rules with
the same semantics that only use symbolic sizes. Unbatched tensors that
are written into (the ``self`` of ``scatter_add``) are cloned after being expanded,
so no index operation ever writes into a stride-0 tensor (inductor miscompiles index
ops on expanded tensors, pytorch/pytorch#183986).

With ``decompose_layer_norm=True`` it also decomposes ``native_layer_norm`` above
autograd: PyTorch's third derivative of it is wrong, and its forward-mode
derivative cannot be traced on fake tensors.

The replacements live in ``torch.library.Library`` objects (the patches
:data:`VMAP_RULES` and :data:`LAYER_NORM_DECOMPOSITION`) that exist only inside the
context manager; outside, PyTorch's own rules are back in place.
"""

from __future__ import annotations

import contextlib
import sys
import warnings

import torch
import torch._decomp
from torch._C._functorch import _add_batch_dim, _unwrap_batched, current_level
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from petfunc._torch import versions
from petfunc._torch.patch import CORRECTNESS, Patch


aten = torch.ops.aten
_BATCHED = torch._C.DispatchKeySet(torch._C.DispatchKey.FuncTorchBatched)


def _below():
    """Run the enclosed ops on the unwrapped (physical) tensors."""
    return torch._C._ExcludeDispatchKeyGuard(_BATCHED)


def _unwrap(tensors, level):
    """``[(physical, bdim or None)]`` and the batch size (``None`` if nothing is batched)."""
    items = [_unwrap_batched(t, level) if isinstance(t, torch.Tensor) else (t, None) for t in tensors]
    size = next((v.shape[b] for v, b in items if b is not None), None)
    return items, size


def _front(value, bdim, size):
    """Batch dimension first; unbatched tensors are expanded (stride 0, read-only use)."""
    if bdim is None:
        return value.unsqueeze(0).expand(size, *value.shape)
    return value if bdim == 0 else value.movedim(bdim, 0)


def _cat(tensors, dim=0):
    level = current_level()
    items, size = _unwrap(tensors, level)
    with _below():
        if size is None:
            return aten.cat.default([v for v, _ in items], dim)
        physical, ndim = [], None
        for value, bdim in items:
            logical = value.dim() - (bdim is not None)
            if logical == 1 and value.shape[-1] == 0:
                continue  # cat's legacy rule: 1-d empty tensors are skipped
            ndim = logical if ndim is None else ndim
            physical.append(_front(value, bdim, size))
        if not physical:  # only empty 1-d tensors
            value, bdim = next((v, b) for v, b in items if b is not None)
            return _add_batch_dim(_front(value, bdim, size), 0, level)
        out = aten.cat.default(physical, dim % ndim + 1)
    return _add_batch_dim(out, 0, level)


def _scatter_add(self, dim, index, src):
    level = current_level()
    items, size = _unwrap((self, index, src), level)
    (s, sb), (i, ib), (x, xb) = items
    with _below():
        if size is None:
            return aten.scatter_add.default(s, dim, i, x)
        logical = s.dim() - (sb is not None)
        target = _front(s, sb, size)
        if sb is None:
            target = target.clone()  # never scatter into an expanded tensor (pytorch#183986)
        out = aten.scatter_add.default(
            target, dim % max(logical, 1) + 1, _front(i, ib, size), _front(x, xb, size)
        )
    return _add_batch_dim(out, 0, level)


def _gather(self, dim, index, sparse_grad=False):
    level = current_level()
    items, size = _unwrap((self, index), level)
    (s, sb), (i, ib) = items
    with _below():
        if size is None:
            return aten.gather.default(s, dim, i, sparse_grad=sparse_grad)
        logical = s.dim() - (sb is not None)
        out = aten.gather.default(
            _front(s, sb, size), dim % max(logical, 1) + 1, _front(i, ib, size), sparse_grad=sparse_grad
        )
    return _add_batch_dim(out, 0, level)


def _slice_backward(grad_output, input_sizes, dim, start, end, step):
    level = current_level()
    g, b = _unwrap_batched(grad_output, level)
    with _below():
        if b is None:
            return aten.slice_backward.default(g, input_sizes, dim, start, end, step)
        g = _front(g, b, None)
        sizes = [g.shape[0], *input_sizes]
        out = aten.slice_backward.default(g, sizes, dim % len(input_sizes) + 1, start, end, step)
    return _add_batch_dim(out, 0, level)


def _mm(self, mat2):
    level = current_level()
    items, size = _unwrap((self, mat2), level)
    (a, ab), (b, bb) = items
    with _below():
        if size is None:
            return aten.mm.default(a, b)
        if bb is None:
            # [B, n, k] rows times one [k, m]: a single mm over all rows
            a = _front(a, ab, size)
            out = aten.mm.default(a.reshape(-1, a.shape[-1]), b).view(size, a.shape[1], b.shape[-1])
        else:
            out = aten.bmm.default(_front(a, ab, size), _front(b, bb, size))
    return _add_batch_dim(out, 0, level)


def _bmm(self, mat2):
    level = current_level()
    items, size = _unwrap((self, mat2), level)
    (a, ab), (b, bb) = items
    with _below():
        if size is None:
            return aten.bmm.default(a, b)
        # [B, b, n, k] x [B, b, k, m] as one bmm over B * b matrices (an unbatched
        # operand is expanded, and reshape copies it)
        a, b = _front(a, ab, size), _front(b, bb, size)
        batch, n, m = a.shape[1], a.shape[2], b.shape[3]
        out = aten.bmm.default(a.reshape(-1, n, a.shape[3]), b.reshape(-1, b.shape[2], m))
        out = out.view(size, batch, n, m)
    return _add_batch_dim(out, 0, level)


_RULES = {
    "cat": _cat,
    "mm": _mm,
    "bmm": _bmm,
    "scatter_add": _scatter_add,
    "gather": _gather,
    "slice_backward": _slice_backward,
}
# ops whose batching rule reads integer sizes and which have a decomposition into
# ops with symbolic-size rules
_DECOMPOSED = ("native_layer_norm", "native_layer_norm_backward")

# native_layer_norm, decomposed above autograd into differentiable primitives (see
# LAYER_NORM_DECOMPOSITION below)
_AUTOGRAD_DECOMPOSED = ("native_layer_norm",)


def _batching_targets():
    return [(torch.library, "Library"), (torch._decomp, "decomposition_table")]


def _ops(names):
    return [getattr(aten, name).default for name in names]


def _register_batching():
    rules = {getattr(aten, name).default: rule for name, rule in _RULES.items()}
    decompositions = {op: torch._decomp.decomposition_table[op] for op in _ops(_DECOMPOSED)}
    library = torch.library.Library("aten", "IMPL", "FuncTorchBatched")
    try:
        with warnings.catch_warnings():
            # "Overriding a previously registered kernel": that is the point
            warnings.simplefilter("ignore", UserWarning)
            for op, rule in {**rules, **decompositions}.items():
                library.impl(op, rule)
    except BaseException:
        library._destroy()
        raise
    return library


def _register_autograd_decompositions():
    decompositions = {op: torch._decomp.decomposition_table[op] for op in _ops(_AUTOGRAD_DECOMPOSED)}
    library = torch.library.Library("aten", "IMPL")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            for op, decomposition in decompositions.items():
                library.impl(op, _without_empty_warning(decomposition), "Autograd")
    except BaseException:
        library._destroy()
        raise
    return library


def _without_empty_warning(decomposition):
    """``decomposition`` without the "var_mean(): degrees of freedom is <= 0" warning
    it gives for an empty input (a structure without edges: no tokens to normalise;
    the result, empty, is right)."""

    def quiet(*args, **kwargs):
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"var_mean\(\): degrees of freedom")
            return decomposition(*args, **kwargs)

    return quiet


def _destroy(library):
    library._destroy()


def _dispatcher_state(names):
    """The dispatcher's registrations of the ops ``names``: what the patch edits."""
    return lambda: tuple(torch._C._dispatch_dump(f"aten::{name}") for name in names)


# WORKAROUND(torch<2.15): torch's C++ batching rules of cat, scatter_add, gather,
# slice_backward and native_layer_norm(_backward) (2.11-2.12: also mm, bmm) read
# sizes as integers, which fixes the sizes of a symbolic trace of a vmap (ensembles,
# Hessians, LLPR). Remove when those rules keep sizes symbolic (the test
# test_torch_batching_rules_fix_sizes in tests/compile/test_patches.py then fails).
# Off: a trace that vmaps (inside symbolic_vmap_rules) is refused with a clear error.
VMAP_RULES = Patch(
    "vmap_rules",
    purpose=CORRECTNESS,
    needed=versions.VMAP_RULES_READ_INTEGER_SIZES,
    summary="vmap batching rules of cat, mm, bmm, scatter_add, gather, slice_backward and the "
    "layer norm pair that keep symbolic sizes symbolic",
    module=sys.modules[__name__],
    install=_register_batching,
    uninstall=_destroy,
    targets=_batching_targets,
    state=_dispatcher_state([*_RULES, *_DECOMPOSED]),
)

# WORKAROUND(torch<2.15): native_layer_norm's third derivative is silently wrong (its
# mean and rstd outputs are not differentiable, so differentiating its double backward
# drops terms: a Hessian-vector-product loss had parameter gradients off by 0.3-2 %
# against finite differences), and its forward-mode derivative breaks make_fx on fake
# tensors (FakeTensorDeviceMismatchError). Remove when torch's layer norm has exact
# higher derivatives. Off: symbolic_vmap_rules(decompose_layer_norm=True) (Hessians,
# Hessian losses) raises a clear error.
LAYER_NORM_DECOMPOSITION = Patch(
    "layer_norm_decomposition",
    purpose=CORRECTNESS,
    needed=versions.LAYER_NORM_HIGHER_DERIVATIVES_WRONG,
    summary="native_layer_norm decomposed above autograd: exact third and forward-mode derivatives",
    module=sys.modules[__name__],
    install=_register_autograd_decompositions,
    uninstall=_destroy,
    targets=_batching_targets,
    state=_dispatcher_state(_AUTOGRAD_DECOMPOSED),
)


class PatchUnavailableError(RuntimeError):
    """A correctness patch that a computation needs is off (``PETFUNC_STOCK_TORCH``,
    ``PETFUNC_PATCHES_OFF``) or could not be installed on this torch."""


def _require(patch: Patch, what: str) -> None:
    if patch.installed or not patch.needed:
        return
    reason = repr(patch.failure) if patch.failure is not None else "switched off by PETFUNC_* settings"
    raise PatchUnavailableError(
        f"{what} needs petfunc's patch {patch.name!r} of torch's internals ({patch.summary}), "
        f"which is not installed ({reason}); without it the results would be wrong or tied to "
        "the traced sizes"
    )


@contextlib.contextmanager
def symbolic_vmap_rules(decompose_layer_norm: bool = False):
    """Use this module's symbolic-size batching rules inside the ``with`` block.

    Args:
        decompose_layer_norm: also decompose ``native_layer_norm`` above autograd,
            for third derivatives (Hessian training) and for traced forward-mode
            derivatives (:data:`LAYER_NORM_DECOMPOSITION`).

    Re-entrant and thread-safe; PyTorch's own rules are restored on exit. Where a
    patch it needs is not installed, the block runs eagerly with torch's own rules
    (right for concrete sizes), and raises :class:`PatchUnavailableError` under
    ``make_fx`` (whose symbolic sizes torch's rules would fix); with
    ``decompose_layer_norm`` it raises in any case.
    """
    with contextlib.ExitStack() as stack:
        stack.enter_context(VMAP_RULES.scope())
        if get_proxy_mode() is not None:
            _require(VMAP_RULES, "a vmap traced with symbolic sizes")
        if decompose_layer_norm:
            stack.enter_context(LAYER_NORM_DECOMPOSITION.scope())
            _require(LAYER_NORM_DECOMPOSITION, "a third or forward-mode derivative of layer norm")
        yield
