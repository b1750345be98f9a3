"""PET's attention within each atom's row of the token grid, written out (matmul,
softmax, matmul) so that it has a double backward: force training differentiates it
twice. The transformer (:mod:`petfunc.model.transformer`) and the fused kernels'
reference formulas (:mod:`petfunc.ops.fused_attention`) both use it."""

from __future__ import annotations

import torch

from petfunc.ops.bmm import bmm_nn, bmm_nt


def grid_attention(qkv: torch.Tensor, bias: torch.Tensor, num_heads: int, scale: float) -> torch.Tensor:
    """Softmax attention within each atom's grid row, written out.

    Args:
        qkv: ``[n_atoms * t, 3d]`` query, key, value of every grid slot.
        bias: ``[n_atoms, t]`` attention bias of each key.
        scale: factor of the queries, ``1 / (sqrt(d / heads) * temperature)``.
    Returns:
        ``[n_atoms, t, d]``.
    """
    n_atoms, t = bias.shape
    d = qkv.shape[1] // 3
    h = d // num_heads
    qkv = qkv.reshape(n_atoms, t, 3, num_heads, h)
    # unbind, not qkv[0], qkv[1], qkv[2]: the backward of three selects builds three
    # zero-filled copies of qkv and adds them; unbind's backward is one stack
    # [n_atoms * heads, t, h]: batched products written as bmm (what matmul runs for
    # 4-d operands); torch 2.11 traces matmul's double backward with fixed sizes
    q, k, v = (z.transpose(1, 2).reshape(n_atoms * num_heads, t, h) for z in qkv.unbind(dim=2))
    # scaling q rather than the scores touches t / h times fewer numbers
    q = q * scale
    scores = bmm_nt(q, k).view(n_atoms, num_heads, t, t)
    weights = torch.softmax(scores + bias[:, None, None, :], dim=-1)
    out = bmm_nn(weights.view(n_atoms * num_heads, t, t), v)
    return out.view(n_atoms, num_heads, t, h).transpose(1, 2)
