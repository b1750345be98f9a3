"""PET's transformer layers, acting on one token sequence per atom.

Token 0 of atom i is its centre (node) token, tokens 1..M its NEF edge slots.
Attention is written out (matmul, softmax, matmul) so that it has a double
backward: force training differentiates it twice. The additive attention bias
``log(max(f, 1e-15))`` down-weights (it does not mask) padded and cut-off keys,
exactly as metatrain does.
"""

from __future__ import annotations

import math

import torch

from . import nn


def init_attention(d: int, generator, dtype, device):
    return {
        "input_linear": nn.init_linear(d, 3 * d, generator, dtype, device),
        "output_linear": nn.init_linear(d, d, generator, dtype, device),
    }


def attention(params, x: torch.Tensor, bias: torch.Tensor, num_heads: int, temperature: float):
    """Multi-head self-attention with a per-key bias.

    Args:
        x: ``[n_atoms, n_tokens, d]`` tokens.
        bias: ``[n_atoms, n_tokens]`` additive bias of each key (same for all queries).
    Returns:
        ``[n_atoms, n_tokens, d]``.
    """
    n, t, d = x.shape
    h = d // num_heads
    qkv = nn.linear(params["input_linear"], x).reshape(n, t, 3, num_heads, h)
    # unbind, not qkv[0], qkv[1], qkv[2]: the backward of three selects builds three
    # zero-filled copies of qkv and adds them; unbind's backward is one stack
    q, k, v = (z.transpose(1, 2) for z in qkv.unbind(dim=2))  # [n, heads, t, h]
    # scaling q rather than the scores touches t / h times fewer numbers
    q = q * (1.0 / (math.sqrt(h) * temperature))
    scores = torch.matmul(q, k.transpose(-2, -1))
    weights = torch.softmax(scores + bias[:, None, None, :], dim=-1)
    out = torch.matmul(weights, v).transpose(1, 2).reshape(n, t, d)
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


def layer(params, config, nodes: torch.Tensor, edges: torch.Tensor, bias: torch.Tensor):
    """One transformer layer.

    Args:
        nodes: ``[n_atoms, d_node]`` node features.
        edges: ``[n_atoms, M, d_pet]`` edge tokens.
        bias: ``[n_atoms, M + 1]`` attention bias.
    Returns:
        new ``(nodes, edges)`` with the same shapes.
    """
    kind, act = config.normalization, config.activation
    expanded = config.d_node != config.d_pet
    center = nn.linear(params["center_contraction"], nodes) if expanded else nodes
    tokens = torch.cat([center[:, None, :], edges], dim=1)

    def attend(x):
        return attention(params["attention"], x, bias, config.num_heads, config.attention_temperature)

    if config.transformer_type == "PreLN":
        new = attend(nn.norm(params["norm_attention"], tokens, kind))
        new_center, new_edges = new[:, 0, :], new[:, 1:, :]
        edges = edges + new_edges
        edges = edges + nn.feedforward(params["mlp"], nn.norm(params["norm_mlp"], edges, kind), act)
    else:  # PostLN
        tokens = nn.norm(params["norm_attention"], tokens + attend(tokens), kind)
        tokens = nn.norm(params["norm_mlp"], tokens + nn.feedforward(params["mlp"], tokens, act), kind)
        new_center, edges = tokens[:, 0, :], tokens[:, 1:, :]

    if expanded:
        nodes = nodes + nn.linear(params["center_expansion"], new_center)
        nodes = nodes + nn.feedforward(
            params["center_mlp"], nn.norm(params["norm_center_features"], nodes, kind), act
        )
    else:
        # metatrain quirk: with d_node == d_pet the node is replaced, no residual
        nodes = new_center
    return nodes, edges
