"""Row lookups in small tables whose adjoint is a matrix product (no atomics).

PET looks up per-species rows for every atom and every edge token: the node and
edge embeddings, and the per-species blocks of the compression layer's first
linear map (see ``petfunc.model._compress``). The adjoint of ``table[index]`` is a
scatter-add of the ``[n, d]`` output gradient into the ``[n_rows, d]`` table, and
inductor's CPU code emits it with one atomic add (a compare-and-swap loop) per
element, because many rows share an index: a few per cent of the carbon
benchmark's training step for its three lookups (docs/performance.md).

With ``one_hot[r, i] = (index[i] == r)`` the same adjoint is the product
``one_hot @ grad``: ``2 n_rows`` FLOPs per gradient element in a library matrix
product, cheaper than an atomic add while the table is small
(:data:`MAX_ROWS`), and the same numbers up to the order of summation (a
deterministic one). :func:`lookup_rows` is that lookup as an
``autograd.Function``: forward ``table[index]`` (inductor fuses the gather into
its consumers), backward the product, forward-mode derivative the gather of the
tangent. The backward is differentiable in turn (by autograd's rule for ``mm``).

Like :mod:`petfunc.ops.permute`, it is used while ``make_fx`` traces (``petfunc.compile``,
``petfunc export``) and for large lookups in eager autograd on the CPU, not for
small ones, on GPUs or in eager calls inside ``torch.func`` transforms (see
:mod:`petfunc.ops.dispatch`); tables with more rows than :data:`MAX_ROWS`
keep the gather's own adjoint.
"""

from __future__ import annotations

import torch

from petfunc.ops.dispatch import use_custom_derivatives


#: largest table whose lookups take the matrix-product adjoint: at 2 x 32 FLOPs
#: per element the product still costs less than one atomic add per element
MAX_ROWS = 32


def _one_hot_rows(index: torch.Tensor, n_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """``[n_rows, n]``: entry ``(r, i)`` is 1 where ``index[i] == r``, else 0."""
    rows = torch.arange(n_rows, device=index.device)
    return (rows[:, None] == index[None, :]).to(dtype)


class LookupRows(torch.autograd.Function):
    """The lookup of :func:`lookup_rows` as an ``autograd.Function``:
    ``LookupRows.apply(table, index)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(table, index):
        return table[index]

    @staticmethod
    def setup_context(ctx, inputs, output):
        table, index = inputs
        ctx.n_rows = table.shape[0]
        ctx.index = index  # an integer tensor: never differentiated

    @staticmethod
    def backward(ctx, grad):
        one_hot = _one_hot_rows(ctx.index, ctx.n_rows, grad.dtype)
        return one_hot @ grad, None

    @staticmethod
    def jvp(ctx, tangent, _):
        return tangent[ctx.index]


def lookup_rows(table: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``table[index]`` for a 1-D integer ``index``, differentiated (in traces, and
    eagerly as the module docstring says) by a one-hot matrix product instead of a
    scatter-add.

    Args:
        table: ``[n_rows, d]`` rows (per species, per charge...).
        index: ``[n]`` row of each output row, in ``[0, n_rows)``.

    Returns:
        ``[n, d]``.
    """
    if (
        table.dim() != 2
        or index.dim() != 1
        or table.shape[0] > MAX_ROWS
        or not use_custom_derivatives(index.shape[0] * table.shape[1], table.device)
    ):
        return table[index]
    return LookupRows.apply(table, index)
