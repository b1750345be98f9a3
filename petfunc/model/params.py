"""PET's parameters: :func:`init` draws a fresh parameter tree for a config.

The tree's dotted paths (:func:`petfunc.tree.flatten`) equal metatrain's
``backend.*`` state-dict keys; ``composition_weights`` ``[n_species]`` (eV) and
``energy_scale`` ``[]`` hold metatrain's composition model and scaler.
"""

from __future__ import annotations

import torch

from petfunc.config import PETConfig
from petfunc.model import long_range, nn, transformer


#: the energy target's name in the heads, as in metatrain (``node_heads.energy...``)
TARGET = "energy"


BLOCK = "energy___0"


def init(
    config: PETConfig,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    device=None,
    generator: torch.Generator | None = None,
):
    """Fresh parameters with torch's default initialisation distributions.

    Args:
        config: the architecture.
        seed: seed of a private ``torch.Generator`` (ignored if ``generator`` is given).
        dtype, device: of every tensor.
        generator: a CPU ``torch.Generator`` to draw from; the global RNG is never used.
    Returns:
        nested dict of tensors; :func:`petfunc.tree.flatten` gives metatrain's keys.
    """
    if generator is None:
        generator = torch.Generator().manual_seed(int(seed))
    g, dt, dev = generator, dtype, device
    d, dn, dh, ns = config.d_pet, config.d_node, config.d_head, config.num_species

    gnn_layers = []
    for layer_index in range(config.num_gnn_layers):
        layer = {
            "trans": {
                "layers": [
                    transformer.init_layer(config, g, dt, dev) for _ in range(config.num_attention_layers)
                ]
            },
            "edge_embedder": nn.init_linear(4, d, g, dt, dev),
            "compress": nn.init_mlp2((2 if layer_index == 0 else 3) * d, d, d, g, dt, dev),
        }
        if layer_index > 0:
            layer["neighbor_embedder"] = nn.init_embedding(ns, d, g, dt, dev)
        gnn_layers.append(layer)

    params = {"gnn_layers": gnn_layers}
    if config.featurizer_type == "feedforward":
        params["combination_norms"] = [
            nn.init_norm(2 * d, "LayerNorm", dt, dev) for _ in range(config.num_gnn_layers)
        ]
        params["combination_mlps"] = [
            nn.init_mlp2(2 * d, 2 * d, d, g, dt, dev) for _ in range(config.num_gnn_layers)
        ]
    r = config.num_readout_layers
    params["node_embedders"] = [nn.init_embedding(ns, dn, g, dt, dev) for _ in range(r)]
    params["edge_embedder"] = nn.init_embedding(ns, d, g, dt, dev)
    if config.system_conditioning:
        params["system_conditioning"] = init_conditioning(config, g, dt, dev)
    if config.long_range.enable:
        params["long_range_featurizer"] = long_range.init(config, g, dt, dev)
    params["node_heads"] = {TARGET: [nn.init_mlp2(dn, dh, dh, g, dt, dev) for _ in range(r)]}
    params["edge_heads"] = {TARGET: [nn.init_mlp2(d, dh, dh, g, dt, dev) for _ in range(r)]}
    params["node_last_layers"] = {TARGET: [{BLOCK: nn.init_linear(dh, 1, g, dt, dev)} for _ in range(r)]}
    params["edge_last_layers"] = {TARGET: [{BLOCK: nn.init_linear(dh, 1, g, dt, dev)} for _ in range(r)]}
    params["composition_weights"] = torch.zeros(ns, dtype=dt, device=device)
    params["energy_scale"] = torch.ones((), dtype=dt, device=device)
    return _without_empty(params)


def _without_empty(tree_):
    """``tree_`` without empty lists and dicts (0 attention or GNN layers): the tree
    that metatrain's flat state dict gives back (:func:`petfunc.tree.unflatten`), so
    that a fresh model and a loaded one have the same structure."""
    if isinstance(tree_, dict):
        kept = {k: _without_empty(v) for k, v in tree_.items()}
        return {k: v for k, v in kept.items() if not (isinstance(v, (dict, list)) and len(v) == 0)}
    if isinstance(tree_, list):
        return [_without_empty(v) for v in tree_]
    return tree_


def init_conditioning(config: PETConfig, generator, dtype, device):
    """Charge and spin embeddings (N(0, 1)) and their projection ``[q || s] -> d_node``:
    Linear(2 d_node, d_node), SiLU, Linear(d_node, d_node), whose last layer (the
    gate) starts at zero, so a fresh model ignores charge and spin until training
    moves the gate (metatrain's initialisation)."""
    dn = config.d_node
    g, dt, dev = generator, dtype, device
    charge = nn.init_embedding(2 * config.max_charge + 1, dn, g, dt, dev)
    spin = nn.init_embedding(config.max_spin_multiplicity, dn, g, dt, dev)
    project = nn.init_mlp2(2 * dn, dn, dn, g, dt, dev)
    project["2"] = {name: torch.zeros_like(value) for name, value in project["2"].items()}
    return {"charge_embedding": charge, "spin_multiplicity_embedding": spin, "project": project}
