"""Shared check: two scalar functions with the same eager autograd derivatives."""

import torch


def assert_same_autograd_derivatives(new, ref, x, rtol=1e-13):
    """``new`` and ``ref`` (scalar functions of ``x``, which requires grad) have the
    same first derivative and the same derivative of that along a random direction,
    both taken with ``torch.autograd`` (``create_graph=True``, as force training does)."""
    (g_new,) = torch.autograd.grad(new(x), x, create_graph=True)
    (g_ref,) = torch.autograd.grad(ref(x), x, create_graph=True)
    torch.testing.assert_close(g_new, g_ref, rtol=rtol, atol=rtol)
    v = torch.randn(x.shape, dtype=x.dtype, generator=torch.Generator().manual_seed(2))
    (h_new,) = torch.autograd.grad((g_new * v).sum(), x)
    (h_ref,) = torch.autograd.grad((g_ref * v).sum(), x)
    torch.testing.assert_close(h_new, h_ref, rtol=rtol, atol=rtol)
