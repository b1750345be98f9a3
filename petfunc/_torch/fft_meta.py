"""Shape functions of the FFT kernels that work with symbolic sizes.

P3M's mesh convolution is ``irfftn(rfftn(rho) * kernel)`` in torch-pme and
``ifftn(fftn(rho) * kernel).real`` in petfunc (:mod:`petfunc.model.long_range`). torch's meta
(shape-only) functions of these kernels (torch 2.11 to 2.14) compute the output's
layout through a helper that permutes and resizes an empty tensor in place. On the
fake tensors of a symbolic trace:

* ``aten._fft_r2c`` on the CPU reads every size as an integer, which fixes the mesh
  sizes of the trace: a :func:`petfunc.compile` graph or an exported model would
  take meshes of the traced shape only;
* ``aten._fft_c2c`` and ``aten._fft_c2r`` fail on symbolic sizes ("tried to
  directly modify sizes for customized tensor", or an internal assert of the
  argument parser). On torch 2.13 this was hidden while r2c fixed the sizes.

:func:`fft_meta` has fake tensors use the shape functions below for these ops for
the duration of a ``with`` block; they give the output the same sizes and strides
directly. The c2c/c2r output is contiguous
in the order (batch dimensions by decreasing input stride, then the transformed
dimensions), which is what the CPU kernels return for contiguous inputs, the layout
P3M passes them; the r2c one follows MKL's kernel (``tests/compile/test_fft_meta.py``
compares them with the kernels).
"""

from __future__ import annotations

import sys

import torch
import torch._subclasses.fake_impls
from torch._meta_registrations import meta_fft_r2c
from torch._subclasses.fake_tensor import FakeTensor, in_kernel_invocation_manager

from petfunc._torch import versions
from petfunc._torch.patch import CORRECTNESS, Patch


aten = torch.ops.aten


def transform_strides(sizes, input_strides, dims):
    """Strides of an FFT kernel's output of ``sizes`` transformed over ``dims``.

    Batch dimensions come first, ordered by decreasing input stride (a stable
    sort), then the transformed dimensions in increasing order; the output is
    contiguous in that order.
    """
    ndim = len(sizes)
    transformed = {d % ndim for d in dims}
    batch = sorted(
        (d for d in range(ndim) if d not in transformed), key=lambda d: input_strides[d], reverse=True
    )
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


def fft_c2c(self, dim, normalization, forward):
    """The output (empty, with its sizes and strides) of ``aten._fft_c2c``."""
    torch._check(self.dtype.is_complex, lambda: f"_fft_c2c expects a complex input, got {self.dtype}")
    if not dim:
        return self.clone()
    return self.new_empty_strided(self.shape, transform_strides(self.shape, self.stride(), dim))


def _uses_all_dims_at_once(dim):
    # cuFFT transforms up to 3 dimensions in one plan, unless they start with 0, 1
    return len(dim) <= 3 and not (len(dim) >= 2 and dim[0] == 0 and dim[1] == 1)


def fft_c2r(self, dim, normalization, last_dim_size):
    """The output (empty, with its sizes and strides) of ``aten._fft_c2r``."""
    torch._check(self.dtype.is_complex, lambda: f"_fft_c2r expects a complex input, got {self.dtype}")
    dim = [d % self.dim() for d in dim]
    sizes = list(self.shape)
    sizes[dim[-1]] = last_dim_size
    real = _REAL[self.dtype]
    # (a fake tensor reports the meta device inside its kernels; fake_device is its own)
    cuda = getattr(self, "fake_device", self.device).type == "cuda"
    if cuda and _uses_all_dims_at_once(dim):
        # the kernel transforms a contiguous copy over every dimension at once
        strides = transform_strides(sizes, _contiguous_strides(self.shape), dim)
        return self.new_empty_strided(sizes, strides, dtype=real)
    # the dimensions but the last are transformed complex-to-complex first
    if len(dim) > 1:
        inner = transform_strides(self.shape, self.stride(), dim[:-1])
    elif cuda:
        inner = _contiguous_strides(self.shape)
    else:
        inner = self.stride()
    return self.new_empty_strided(sizes, transform_strides(sizes, inner, dim[-1:]), dtype=real)


def fft_r2c(self, dim, normalization, onesided):
    """The output (empty, with its sizes and strides) of ``aten._fft_r2c``."""
    torch._check(self.dtype.is_floating_point, lambda: f"_fft_r2c expects a real input, got {self.dtype}")
    # (a fake tensor reports the meta device inside its kernels; fake_device is its own)
    if getattr(self, "fake_device", self.device).type != "cpu":
        # torch's own shape function (it specialises the sizes; GPUs are not traced here)
        return meta_fft_r2c(self, dim, normalization, onesided)
    dim = [d % self.dim() for d in dim]
    sizes = list(self.shape)
    if onesided:
        sizes[dim[-1]] = sizes[dim[-1]] // 2 + 1
    # MKL's kernel: batch dimensions by decreasing input stride, then the transformed
    # ones but the last by decreasing input stride, then the last
    strides = self.stride()
    batch = sorted((d for d in range(self.dim()) if d not in dim), key=lambda d: strides[d], reverse=True)
    order = batch + sorted(dim[:-1], key=lambda d: strides[d], reverse=True) + dim[-1:]
    out_strides = [0] * self.dim()
    running = 1
    for d in reversed(order):
        out_strides[d] = running
        running = running * sizes[d]
    complex_dtype = {
        torch.float16: torch.complex32,
        torch.float32: torch.complex64,
        torch.float64: torch.complex128,
    }[self.dtype]
    return self.new_empty_strided(sizes, out_strides, dtype=complex_dtype)


_RULES = {aten._fft_r2c.default: fft_r2c, aten._fft_c2c.default: fft_c2c, aten._fft_c2r.default: fft_c2r}


def _check(func):
    return func in _RULES


def _fake_impl(fake_mode, func, *args, **kwargs):
    # consulted by FakeTensorMode before an op's meta function
    device = args[0].fake_device
    with in_kernel_invocation_manager(fake_mode):
        out = _RULES[func](*args, **kwargs)
    return FakeTensor(fake_mode, out, device)


def _targets():
    return [(torch._subclasses.fake_impls, "op_implementations_checks")]


def _install():
    (owner, name), entry = _targets()[0], (_check, _fake_impl)
    getattr(owner, name).insert(0, entry)
    return entry


def _uninstall(entry):
    (owner, name) = _targets()[0]
    getattr(owner, name).remove(entry)


# WORKAROUND(torch<2.15): torch's meta functions of _fft_r2c (CPU), _fft_c2c and
# _fft_c2r read symbolic sizes as integers or fail on them, so P3M's mesh
# convolution does not trace with symbolic mesh sizes. Remove when torch's meta
# functions keep sizes symbolic (the test test_torch_fft_meta_fixes_sizes in
# tests/compile/test_patches.py then fails). Off: a traced FFT fails inside torch
# (c2c, c2r) or fixes the mesh sizes, which the trace guards of petfunc.compile then
# enforce (a mesh of another size is refused with a ValueError).
FFT_META = Patch(
    "fft_meta",
    purpose=CORRECTNESS,
    needed=versions.FFT_META_NOT_SYMBOLIC,
    summary="fake-tensor shape functions of the FFT kernels that keep symbolic sizes",
    module=sys.modules[__name__],
    install=_install,
    uninstall=_uninstall,
    targets=_targets,
)


def fft_meta():
    """Use the shape functions above inside the block (re-entrant): the patch
    :data:`FFT_META` held for a ``with`` block."""
    return FFT_META.scope()
