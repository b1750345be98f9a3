"""Shape functions of the FFT kernels that work with symbolic sizes (torch 2.11).

P3M's mesh convolution is ``irfftn(rfftn(rho) * kernel)``. In torch 2.11 the meta
(shape-only) functions of ``aten._fft_c2c`` and ``aten._fft_c2r`` build their
output by resizing an empty tensor in place and then restriding it. On the fake
tensors of a symbolic trace that fails ("tried to directly modify sizes for
customized tensor", or an internal assert of the argument parser), so a long-range
model could not be traced by :func:`petfunc.compile`. torch 2.13's versions work.

:func:`fft_meta` has fake tensors use other shape functions for the two ops, for
the duration of a ``with`` block and only on torch < 2.13; they give the output the
same sizes and strides directly: the output is contiguous in the order (batch
dimensions by decreasing input stride, then the transformed dimensions), which is
what the CPU kernels return for contiguous inputs (``tests/test_long_range.py``),
the layout P3M passes them.
"""

from __future__ import annotations

import contextlib

import torch

from ._scoped import Scoped

aten = torch.ops.aten

NEEDED = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) < (2, 13)


def transform_strides(sizes, input_strides, dims):
    """Strides of an FFT kernel's output of ``sizes`` transformed over ``dims``.

    Batch dimensions come first, ordered by decreasing input stride (a stable
    sort), then the transformed dimensions in increasing order; the output is
    contiguous in that order.
    """
    ndim = len(sizes)
    transformed = {d % ndim for d in dims}
    batch = sorted((d for d in range(ndim) if d not in transformed), key=lambda d: input_strides[d], reverse=True)
    order = batch + [d for d in range(ndim) if d in transformed]
    strides = [0] * ndim
    running = 1
    for d in reversed(order):
        strides[d] = running
        running = running * sizes[d]
    return strides


def _contiguous_strides(sizes):
    return transform_strides(sizes, [0] * len(sizes), range(len(sizes)))


_REAL = {torch.complex32: torch.float16, torch.complex64: torch.float32, torch.complex128: torch.float64}


def _c2c(self, dim, normalization, forward):
    torch._check(self.dtype.is_complex, lambda: f"_fft_c2c expects a complex input, got {self.dtype}")
    if not dim:
        return self.clone()
    return self.new_empty_strided(self.shape, transform_strides(self.shape, self.stride(), dim))


def _uses_all_dims_at_once(dim):
    # cuFFT transforms up to 3 dimensions in one plan, unless they start with 0, 1
    return len(dim) <= 3 and not (len(dim) >= 2 and dim[0] == 0 and dim[1] == 1)


def _c2r(self, dim, normalization, last_dim_size):
    torch._check(self.dtype.is_complex, lambda: f"_fft_c2r expects a complex input, got {self.dtype}")
    dim = [d % self.dim() for d in dim]
    sizes = list(self.shape)
    sizes[dim[-1]] = last_dim_size
    real = _REAL[self.dtype]
    if self.device.type == "cuda" and _uses_all_dims_at_once(dim):
        # the kernel transforms a contiguous copy over every dimension at once
        strides = transform_strides(sizes, _contiguous_strides(self.shape), dim)
        return self.new_empty_strided(sizes, strides, dtype=real)
    # the dimensions but the last are transformed complex-to-complex first
    if len(dim) > 1:
        inner = transform_strides(self.shape, self.stride(), dim[:-1])
    elif self.device.type == "cuda":
        inner = _contiguous_strides(self.shape)
    else:
        inner = self.stride()
    return self.new_empty_strided(sizes, transform_strides(sizes, inner, dim[-1:]), dtype=real)


_RULES = {aten._fft_c2c.default: _c2c, aten._fft_c2r.default: _c2r}


def _check(func):
    return func in _RULES


def _fake_impl(fake_mode, func, *args, **kwargs):
    # consulted by FakeTensorMode before an op's meta function
    from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

    device = args[0].fake_device
    with in_kernel_invocation_manager(fake_mode):
        out = _RULES[func](*args, **kwargs)
    return FakeTensor(fake_mode, out, device)


def _install():
    from torch._subclasses.fake_impls import op_implementations_checks

    entry = (_check, _fake_impl)
    op_implementations_checks.insert(0, entry)
    return entry


def _uninstall(entry):
    from torch._subclasses.fake_impls import op_implementations_checks

    op_implementations_checks.remove(entry)


_scope = Scoped(_install, _uninstall)


def fft_meta():
    """Use the shape functions above inside the block (torch < 2.13; re-entrant)."""
    return _scope() if NEEDED else contextlib.nullcontext()
