"""PET's transformer layers, acting on one token sequence per atom.

Tokens are kept in a flat list (centre tokens, then edge tokens) on which every
per-token layer runs; attention gathers each atom's tokens into a padded grid row
(centre first, then its NEF edge slots) and gathers the result back. Attention is
written out (matmul, softmax, matmul) so that it has a double backward: force
training differentiates it twice. The additive attention bias ``log(max(f, 1e-15))``
down-weights cut-off keys without masking them, exactly as metatrain does; padded
slots get the same bias and zero query, key and value vectors. Inside
``petfunc.compile(..., fused_attention=True)`` the grid's attention is one CPU
kernel per derivative order instead (:mod:`petfunc.ops.fused_attention`).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from petfunc.model import nn
from petfunc.ops import fused_attention
from petfunc.ops.attention import grid_attention
from petfunc.ops.permute import permute_rows


def init_attention(d: int, generator, dtype, device):
    return {
        "input_linear": nn.init_linear(d, 3 * d, generator, dtype, device),
        "output_linear": nn.init_linear(d, d, generator, dtype, device),
    }


class TokenGrid(NamedTuple):
    """Where each atom's tokens sit in the padded attention grid.

    The token list is ``[n_atoms + n_kept]``: centre tokens first, then the edge
    tokens. The grid is ``[n_atoms, M + 1]``: column 0 holds atom i's centre token,
    columns 1..M its edge tokens and padding.

    Attributes:
        index: ``[n_atoms, M + 1]`` token in each grid slot (padding: any real token).
        mask: ``[n_atoms, M + 1, 1]`` True for real slots.
        slot: ``[n_atoms + n_kept]`` flat grid slot of each token.
        bias: ``[n_atoms, M + 1]`` attention bias of each key, ``log(max(f, 1e-15))``
            with f = 1 for the centre, the cutoff factor for edges and 0 for padding.
    """

    index: torch.Tensor
    mask: torch.Tensor
    slot: torch.Tensor
    bias: torch.Tensor


def token_grid(nef_index, nef_mask, nef_slot, centers, factors) -> TokenGrid:
    """The :class:`TokenGrid` of a batch.

    Args:
        nef_index, nef_mask, nef_slot: of :class:`petfunc.graph.neighbors.Neighbors`.
        centers: ``[n_kept]`` centre atom of each edge token.
        factors: ``[n_kept]`` cutoff factor of each edge token (carries gradients).
    """
    n_atoms, width = nef_mask.shape
    atoms = torch.arange(n_atoms, device=nef_mask.device)
    index = torch.cat([atoms[:, None], n_atoms + nef_index], dim=1)
    mask = torch.cat([nef_mask.new_ones((n_atoms, 1)), nef_mask], dim=1)
    # edge slot i*M + k of the [n_atoms, M] grid is i*(M+1) + 1 + k of the full grid
    slot = torch.cat([atoms * (width + 1), nef_slot + centers + 1])
    grid_factors = permute_rows(factors, nef_index.reshape(-1), nef_slot, mask=nef_mask.reshape(-1))
    grid_factors = grid_factors.reshape(n_atoms, width)
    ones = factors.new_ones((n_atoms, 1))
    # log(max(f, 1e-15)) down-weights (does not mask) cut keys, as metatrain does;
    # padded keys get the same bias and zero query/key/value vectors
    bias = torch.log(torch.cat([ones, grid_factors], dim=1).clamp_min(1e-15))
    return TokenGrid(index, mask[..., None], slot, bias)


def attention(params, x: torch.Tensor, grid: TokenGrid, num_heads: int, temperature: float):
    """Multi-head self-attention among the tokens of each atom.

    Args:
        x: ``[n_tokens, d]`` tokens (centres then edges, see :class:`TokenGrid`).
        grid: the token layout.
    Returns:
        ``[n_tokens, d]``.
    """
    d = x.shape[1]
    n_atoms, t = grid.bias.shape
    h = d // num_heads
    qkv = nn.linear(params["input_linear"], x)  # per token: no work on padding
    # to the grid; padded slots get zero q, k, v (and no gradient to anything).
    # Token list and grid are in one-to-one correspondence, so both directions and
    # all their derivatives are gathers (no atomic scatter-adds)
    index, mask = grid.index.reshape(-1), grid.mask.reshape(-1)
    qkv = permute_rows(qkv, index, grid.slot, mask=mask)
    scale = 1.0 / (math.sqrt(h) * temperature)
    if fused_attention.enabled():
        # one C++ pass per atom, no [atoms, heads, t, t] grids (petfunc.ops.fused_attention)
        out = fused_attention.attention(qkv.reshape(n_atoms, t, 3 * d), grid.bias, num_heads, scale)
    else:
        out = grid_attention(qkv, grid.bias, num_heads, scale)
    out = permute_rows(
        out.reshape(n_atoms * t, d), grid.slot, index, inverse_mask=mask
    )  # back to the token list
    return nn.linear(params["output_linear"], out)


def init_layer(config, generator, dtype, device):
    d, dn, act, kind = config.d_pet, config.d_node, config.activation, config.normalization
    p = {
        "attention": init_attention(d, generator, dtype, device),
        "norm_attention": nn.init_norm(d, kind, dtype, device),
        "norm_mlp": nn.init_norm(d, kind, dtype, device),
        "mlp": nn.init_feedforward(d, config.d_feedforward, act, generator, dtype, device),
    }
    if dn != d:
        p["center_contraction"] = nn.init_linear(dn, d, generator, dtype, device)
        p["center_expansion"] = nn.init_linear(d, dn, generator, dtype, device)
        p["norm_center_features"] = nn.init_norm(dn, kind, dtype, device)
        p["center_mlp"] = nn.init_feedforward(dn, 2 * dn, act, generator, dtype, device)
    return p


def layer(params, config, nodes: torch.Tensor, edges: torch.Tensor, grid: TokenGrid):
    """One transformer layer.

    Args:
        nodes: ``[n_atoms, d_node]`` node features.
        edges: ``[n_kept, d_pet]`` edge tokens.
        grid: the attention layout of :func:`token_grid`.
    Returns:
        new ``(nodes, edges)`` with the same shapes.
    """
    kind, act = config.normalization, config.activation
    expanded = config.d_node != config.d_pet
    n_atoms = nodes.shape[0]
    center = nn.linear(params["center_contraction"], nodes) if expanded else nodes
    tokens = torch.cat([center, edges], dim=0)

    def attend(x):
        return attention(params["attention"], x, grid, config.num_heads, config.attention_temperature)

    if config.transformer_type == "PreLN":
        new = attend(nn.norm(params["norm_attention"], tokens, kind))
        new_center, new_edges = new[:n_atoms], new[n_atoms:]
        edges = edges + new_edges
        edges = edges + nn.feedforward(params["mlp"], nn.norm(params["norm_mlp"], edges, kind), act)
    else:  # PostLN
        tokens = nn.norm(params["norm_attention"], tokens + attend(tokens), kind)
        tokens = nn.norm(params["norm_mlp"], tokens + nn.feedforward(params["mlp"], tokens, act), kind)
        new_center, edges = tokens[:n_atoms], tokens[n_atoms:]

    if expanded:
        nodes = nodes + nn.linear(params["center_expansion"], new_center)
        nodes = nodes + nn.feedforward(
            params["center_mlp"], nn.norm(params["norm_center_features"], nodes, kind), act
        )
    else:
        # metatrain quirk: with d_node == d_pet the node is replaced, no residual
        nodes = new_center
    return nodes, edges
