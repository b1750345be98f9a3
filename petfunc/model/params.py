"""PET's parameters: :func:`init` draws a fresh parameter tree for a config, and
:func:`check_params` checks a tree against a config.

The tree's dotted paths (:func:`petfunc.tree.flatten`) equal metatrain's
``backend.*`` state-dict keys; ``composition_weights`` ``[n_species]`` (eV) and
``energy_scale`` ``[]`` hold metatrain's composition model and scaler.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from petfunc import tree
from petfunc.config import PETConfig
from petfunc.model import long_range, nn, transformer


#: the energy target's name in the heads, as in metatrain (``node_heads.energy...``)
TARGET = "energy"


BLOCK = "energy___0"

#: parameters that are not metatrain ``backend.*`` network weights; their dtype may
#: differ from the network's (metatrain keeps them in float64, and the energy casts them)
EXTRA_KEYS = ("composition_weights", "energy_scale")

#: how many keys an error lists of each kind of mismatch
LISTED_KEYS = 8


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


# ---------------------------------------------------------------------------------------
# checking a parameter tree against a config


def expected_shapes(config: PETConfig) -> dict[str, torch.Size]:
    """``{name: shape}`` of every parameter of ``config`` (in init's order)."""
    # the draws are cheap next to reading a file; float32 halves them for big models
    return {k: v.shape for k, v in tree.flatten(init(config, dtype=torch.float32)).items()}


def _listed(keys: list[str]) -> str:
    shown = keys[:LISTED_KEYS]
    return str(shown) + (f" and {len(keys) - len(shown)} more" if len(keys) > len(shown) else "")


def _mixed(flat: dict, network: list[str]) -> list[str]:
    """The first network weight whose dtype differs from the first one's, and the first
    tensor on another device than the first one."""
    problems = []
    first = network[0]
    for key in network[1:]:
        if flat[key].dtype != flat[first].dtype:
            problems.append(
                f"{key} is {flat[key].dtype} but {first} is {flat[first].dtype} (give every network "
                "weight one dtype)"
            )
            break
    for key, value in flat.items():
        if isinstance(value, torch.Tensor) and value.device != flat[first].device:
            problems.append(
                f"{key} is on {value.device} but {first} on {flat[first].device} (put every parameter "
                "on one device)"
            )
            break
    return problems


def check_params(config: PETConfig, params, what: str = "parameters", expected=None) -> None:
    """Check a parameter tree against ``config`` before the energy sees it.

    The energy function reads the tree without checking it (it is traced), and a
    wrong tree gives a bare ``KeyError: 'weight'`` or a matmul's size error there.
    This names every missing and unexpected parameter (the first
    :data:`LISTED_KEYS` of each), each parameter whose shape differs (got and
    expected) or that is not a floating tensor, a network weight whose dtype differs
    from the others' (:data:`EXTRA_KEYS` may differ), and a tensor on another device.

    Args:
        config: the architecture.
        params: the tree, as :func:`init` makes it or a file gives it.
        what: how the error names the tree (``"the parameters in 'model.pt'"``).
        expected: ``{name: shape}`` (default: :func:`expected_shapes` of ``config``).

    Raises:
        TypeError: ``config`` is not a :class:`~petfunc.PETConfig`.
        ValueError: the tree does not match; the message names each mismatch.
    """
    if not isinstance(config, PETConfig):
        raise TypeError(f"config must be a PETConfig, got {type(config).__name__}")
    if not isinstance(params, Mapping):
        raise ValueError(
            f"{what} must be a nested dict of tensors, as petfunc.init(config) makes, got "
            f"{type(params).__name__}"
        )
    expected = expected_shapes(config) if expected is None else expected
    flat = tree.flatten(params)
    problems = []
    missing = [k for k in expected if k not in flat]
    unexpected = [k for k in flat if k not in expected]
    if missing:
        problems.append(f"missing {_listed(missing)}")
    if unexpected:
        problems.append(f"unexpected {_listed(unexpected)}")
    network = []
    for key, shape in expected.items():
        value = flat.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif value.shape != shape:
            problems.append(f"{key} has shape {list(value.shape)}, expected {list(shape)}")
        elif not value.is_floating_point():
            problems.append(f"{key} has dtype {value.dtype}, expected a floating dtype")
        elif key not in EXTRA_KEYS:
            network.append(key)
    if network:
        problems += _mixed(flat, network)
    if problems:
        raise ValueError(
            f"{what} do not match the config: "
            + "; ".join(problems)
            + ". Parameters for a config come from petfunc.init(config), or from a file with the "
            "config it was saved with (load_params and load_model return both)"
        )
