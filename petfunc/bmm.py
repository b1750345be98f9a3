"""Batched matrix products whose derivatives keep every operand's own layout.

Attention multiplies ``[b, t, h]`` queries, keys and values: ``q @ k^T`` and
``weights @ v``. Autograd's rule for ``torch.bmm`` computes the gradient of an
operand that enters as a transposed view (``k.transpose(1, 2)``) as a product laid
out for the view, so the gradient of ``k`` comes back transposed (token index
fastest). The derivatives of those derivatives, taken in force training, do the
same to the ``[t, t]`` attention weights. Inductor then transposes whole grids to
combine such gradients with those in the natural layout, and gathers the token
gradients out of the grid element by element.

Here the three products ``a @ b``, ``a @ b^T`` and ``a^T @ b`` are one family of
``autograd.Function``\\ s whose derivatives (of every order, and forward-mode) are
members of the family, each computing its result in the layout of the operand it
belongs to: the gradient of ``k`` in ``q @ k^T`` is ``g^T @ q``, not ``(q^T @ g)^T``.
The numbers are those of ``torch.bmm``.

Like :mod:`petfunc.permute`, the functions are used only while ``make_fx`` traces
(compiled steps), where they change the generated code; eager calls are plain
``torch.bmm`` (a ``torch.func`` call of an ``autograd.Function`` costs Python time).
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(1, 2)


class _Product(torch.autograd.Function):
    """Base of the three products: saves both operands for both derivative modes."""

    generate_vmap_rule = True

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)


def _sum(x, y):
    return y if x is None else x + y


class _NN(_Product):
    """``a @ b``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _NT.apply(g, b), _TN.apply(a, g)

    @staticmethod
    def jvp(ctx, a_dot, b_dot):
        a, b = ctx.saved_tensors
        out = None if a_dot is None else _NN.apply(a_dot, b)
        return out if b_dot is None else _sum(out, _NN.apply(a, b_dot))


class _NT(_Product):
    """``a @ b^T``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(a, _t(b))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _NN.apply(g, b), _TN.apply(g, a)

    @staticmethod
    def jvp(ctx, a_dot, b_dot):
        a, b = ctx.saved_tensors
        out = None if a_dot is None else _NT.apply(a_dot, b)
        return out if b_dot is None else _sum(out, _NT.apply(a, b_dot))


class _TN(_Product):
    """``a^T @ b``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(_t(a), b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return _NT.apply(b, g), _NN.apply(a, g)

    @staticmethod
    def jvp(ctx, a_dot, b_dot):
        a, b = ctx.saved_tensors
        out = None if a_dot is None else _TN.apply(a_dot, b)
        return out if b_dot is None else _sum(out, _TN.apply(a, b_dot))


def bmm_nn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of ``[n, i, k]`` and ``[n, k, j]``: ``[n, i, j]``."""
    if get_proxy_mode() is None:  # eager: see the module docstring
        return torch.bmm(a, b)
    return _NN.apply(a, b)


def bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` of ``[n, i, k]`` and ``[n, j, k]``: ``[n, i, j]``."""
    if get_proxy_mode() is None:
        return torch.bmm(a, _t(b))
    return _NT.apply(a, b)


def bmm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T @ b`` of ``[n, k, i]`` and ``[n, k, j]``: ``[n, i, j]``."""
    if get_proxy_mode() is None:
        return torch.bmm(_t(a), b)
    return _TN.apply(a, b)
