"""Row gathers whose adjoint is a gather too (no scatter, no atomics).

PET moves tokens between layouts with gathers that are one-to-one: the token list
to the padded attention grid and back, and each edge to its reversed edge. The
autograd adjoint of ``x[index]`` is a scatter-add, which a compiler must emit with
atomic adds (inductor on CPU: a compare-and-swap loop per element), because it
cannot know that ``index`` never repeats. When the inverse map is known, the adjoint
is itself a gather: for ``y[r] = x[index[r]]`` (rows with ``mask[r]`` False set to
0) and every row ``s`` of ``x`` reached by exactly one unmasked row
``r = inverse[s]``, ``x_bar[s] = y_bar[inverse[s]]``.

:func:`permute_rows` is that gather as an ``autograd.Function`` whose backward is
:func:`permute_rows` with the roles of the two maps swapped and whose forward-mode
derivative is the same gather of the tangent, so derivatives of any order (force
training, Hessians, Hessian matching) stay gathers. It works under ``torch.func``
transforms (``grad``, ``jvp``, ``vmap``) and ``make_fx``.

The function is used while ``make_fx`` traces (``petfunc.compile``, ``petfunc
export``), where it changes the compiled code, and for large gathers in eager
autograd on the CPU, where it replaces PyTorch's scatter-add (with atomics); small
gathers, GPUs and eager calls inside ``torch.func`` transforms use a plain gather
(see :mod:`petfunc.ops.dispatch`).
"""

from __future__ import annotations

import math

import torch

from petfunc.ops.dispatch import use_custom_derivatives


def _gather(x: torch.Tensor, index: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    y = x[index]
    if mask is not None:
        y = torch.where(mask.reshape(mask.shape + (1,) * (y.dim() - mask.dim())), y, 0.0)
    return y


class PermuteRows(torch.autograd.Function):
    """The gather of :func:`permute_rows` as an ``autograd.Function``:
    ``PermuteRows.apply(x, index, mask, inverse, inverse_mask)``."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x, index, mask, inverse, inverse_mask):
        return _gather(x, index, mask)

    @staticmethod
    def setup_context(ctx, inputs, output):
        _, index, mask, inverse, inverse_mask = inputs
        # integer index and bool mask tensors: never differentiated
        ctx.maps = (index, mask, inverse, inverse_mask)

    @staticmethod
    def backward(ctx, grad):
        index, mask, inverse, inverse_mask = ctx.maps
        return PermuteRows.apply(grad, inverse, inverse_mask, index, mask), None, None, None, None

    @staticmethod
    def jvp(ctx, tangent, *_):
        index, mask, inverse, inverse_mask = ctx.maps
        return PermuteRows.apply(tangent, index, mask, inverse, inverse_mask)


def permute_rows(
    x: torch.Tensor,
    index: torch.Tensor,
    inverse: torch.Tensor,
    mask: torch.Tensor | None = None,
    inverse_mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """``y = x[index]`` (rows where ``mask`` is False are 0), differentiated by gathers.

    Args:
        x: ``[n, ...]`` rows to gather.
        index: ``[m]`` row of ``x`` for each output row (any valid row where masked).
        inverse: ``[n]`` output row that holds each row of ``x`` (any valid output row
            where ``inverse_mask`` is False).
        mask: ``[m]`` bool, output rows that are real (default: all).
        inverse_mask: ``[n]`` bool, rows of ``x`` that appear in the output (default:
            all); rows that do not get a zero gradient.

    The maps must be inverse to each other on the real rows: ``index[inverse[s]] ==
    s`` for every real ``s`` and ``inverse[index[r]] == r`` for every real ``r``.
    That is not checked here (it is a property of the neighbour layout, checked when
    it is built); if it fails, the derivatives are wrong.

    Returns:
        ``[m, ...]``.
    """
    if not use_custom_derivatives(index.shape[0] * math.prod(x.shape[1:]), x.device):
        return _gather(x, index, mask)  # small or under eager torch.func: see the module docstring
    return PermuteRows.apply(x, index, mask, inverse, inverse_mask)
