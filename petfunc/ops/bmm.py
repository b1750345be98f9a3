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

The functions are used only while ``make_fx`` traces (compiled steps), where they
change the generated code; eager calls are plain ``torch.bmm``. (Unlike
:mod:`petfunc.ops.permute` and :mod:`petfunc.ops.lookup`, whose adjoints replace a slow
scatter-add, they gave eager autograd nothing to gain: eager training steps were
faster with the gathers alone; and a ``torch.func`` call of an
``autograd.Function`` costs Python time.)
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


def _product_rule(product):
    """The forward-mode derivative of a bilinear ``product``:
    ``product(a_dot, b) + product(a, b_dot)`` (absent tangents are zero)."""

    def jvp(ctx, a_dot, b_dot):
        a, b = ctx.saved_tensors
        terms = [product(a_dot, b)] if a_dot is not None else []
        if b_dot is not None:
            terms.append(product(a, b_dot))
        return terms[0] if len(terms) == 1 else terms[0] + terms[1]

    return staticmethod(jvp)


class BmmNN(_Product):
    """``a @ b``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(a, b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return BmmNT.apply(g, b), BmmTN.apply(a, g)

    jvp = _product_rule(lambda a, b: BmmNN.apply(a, b))


class BmmNT(_Product):
    """``a @ b^T``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(a, _t(b))

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return BmmNN.apply(g, b), BmmTN.apply(g, a)

    jvp = _product_rule(lambda a, b: BmmNT.apply(a, b))


class BmmTN(_Product):
    """``a^T @ b``."""

    @staticmethod
    def forward(a, b):
        return torch.bmm(_t(a), b)

    @staticmethod
    def backward(ctx, g):
        a, b = ctx.saved_tensors
        return BmmNT.apply(b, g), BmmNN.apply(a, g)

    jvp = _product_rule(lambda a, b: BmmTN.apply(a, b))


def _call(product, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if get_proxy_mode() is None:  # eager: its own forward, a plain bmm (module docstring)
        return product.forward(a, b)
    return product.apply(a, b)


def bmm_nn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` of ``[n, i, k]`` and ``[n, k, j]``: ``[n, i, j]``."""
    return _call(BmmNN, a, b)


def bmm_nt(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b^T`` of ``[n, i, k]`` and ``[n, j, k]``: ``[n, i, j]``."""
    return _call(BmmNT, a, b)


def bmm_tn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a^T @ b`` of ``[n, k, i]`` and ``[n, k, j]``: ``[n, i, j]``."""
    return _call(BmmTN, a, b)
