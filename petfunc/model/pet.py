"""PET as pure functions: ``init(config, seed) -> params`` and
``energy(params, positions, cell, neighbors, config) -> [n_structures]``.

Paper/metatrain symbols and their names here:

=====================  ===========================================================
r_e, d_e, f_e          ``vectors``, ``distances``, ``cutoff_factors`` (flat edges)
V_ik, D_ik, F_ik       token (kept-edge) vectors, sqrt(|V|^2 + 1e-15), factors
h_i, m_ik              node features (d_node) and edge messages (d_pet)
eps_i                  raw atomic energy; E_s = c sum eps_i + sum w_Z (+ ZBL)
=====================  ===========================================================

Every position-dependent quantity (edge vectors, distances, switching function,
adaptive radii) is computed inside :func:`energy`, so ``torch.func.grad`` of it gives
exact forces and stress. The parameter tree's dotted paths equal metatrain's
``backend.*`` state-dict keys; ``composition_weights`` ``[n_species]`` (eV) and
``energy_scale`` ``[]`` hold metatrain's composition model and scaler.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from petfunc.config import PETConfig
from petfunc.graph.checks import check_sizes
from petfunc.graph.neighbors import Neighbors
from petfunc.model import long_range, nn, transformer, zbl
from petfunc.model.geometry import cutoff_factors, edge_vectors
from petfunc.model.params import BLOCK, TARGET, init
from petfunc.ops.lookup import lookup_rows
from petfunc.ops.permute import permute_rows
from petfunc.remat import call as remat_call


# ---------------------------------------------------------------------------------------
# parameters


# ---------------------------------------------------------------------------------------
# geometry


# ---------------------------------------------------------------------------------------
# the network


def conditioning(params, config: PETConfig, neighbors: Neighbors):
    """Per-atom conditioning features ``[n_atoms, d_node]`` of each structure's charge
    q and spin multiplicity 2S+1: gate(SiLU(Lin([Q[q + max_charge] || S[2S+1 - 1]]))),
    added to the node features after every GNN layer."""
    p = params["system_conditioning"]
    charge = nn.embedding(p["charge_embedding"], neighbors.charge + config.max_charge)
    spin = nn.embedding(p["spin_multiplicity_embedding"], neighbors.spin_multiplicity - 1)
    per_structure = nn.mlp2(p["project"], torch.cat([charge, spin], dim=1))  # [n_structures, d_node]
    return per_structure[neighbors.structure_index]


def _readout(params, config, layer: int, nodes, edges, factors, centers):
    """Atomic energies ``[n_atoms]`` of one readout layer: node term plus the sum of
    the edge terms (times their cutoff factors) over each atom's tokens."""
    node_hidden = nn.mlp2(params["node_heads"][TARGET][layer], nodes, final_activation=True)
    edge_hidden = nn.mlp2(params["edge_heads"][TARGET][layer], edges, final_activation=True)
    node_energy = nn.linear(params["node_last_layers"][TARGET][layer][BLOCK], node_hidden)[:, 0]
    edge_energy = nn.linear(params["edge_last_layers"][TARGET][layer][BLOCK], edge_hidden)[:, 0]
    return node_energy.scatter_add(0, centers, edge_energy * factors)


def _compress(params, layer: int, geometry, species_nbr, messages, message_table=None):
    """metatrain's compressed edge tokens ``[n_kept, d_pet]``:
    ``mlp2(compress, [edge_embedder(geometry), neighbor_embedder(Z_j), message])``
    (layer 0 has no neighbour embedding).

    Computed with the first linear layer distributed over the blocks of its input,
    which is the same function: the edge embedding is linear in the 4 geometry
    numbers, so its block folds into a ``[d_hidden, 4]`` matrix, and a block whose
    input takes one of n_species values (the neighbour embedding, and in layer 0 the
    messages, which are still an embedding of Z_j) becomes a per-species table
    gathered per edge. Per edge token the first layer then multiplies a 132-wide
    input instead of a 384-wide one (a 4-wide one instead of 256 in layer 0): about
    6 % of the model's matmul FLOPs, in every derivative too.

    Args:
        geometry: ``[n_kept, 4]`` edge vector and length.
        species_nbr: ``[n_kept]`` species index of each edge's neighbour.
        messages: ``[n_kept, d_pet]`` messages (ignored when ``message_table`` is given).
        message_table: ``[n_species, d_pet]`` with ``messages == message_table[species_nbr]``.
    """
    embedder = params["edge_embedder"]
    d = embedder["weight"].shape[0]  # d_pet
    first = params["compress"]["0"]
    weight = first["weight"]
    w_geometry, w_messages = weight[:, :d], weight[:, -d:]
    # fold the edge embedder: W_g (W_e x + b_e) + b = (W_g W_e) x + (W_g b_e + b)
    w_folded = w_geometry @ embedder["weight"]  # [d_hidden, 4]
    bias = torch.addmv(first["bias"], w_geometry, embedder["bias"])
    table = None
    if layer > 0:
        table = params["neighbor_embedder"]["weight"] @ weight[:, d : 2 * d].t()  # [n_species, d_hidden]
    if message_table is not None:
        from_messages = message_table @ w_messages.t()
        table = from_messages if table is None else table + from_messages
        hidden = torch.addmm(bias, geometry, w_folded.t())
    else:
        inputs = torch.cat([geometry, messages], dim=1)
        hidden = torch.addmm(bias, inputs, torch.cat([w_folded, w_messages], dim=1).t())
    if table is not None:
        hidden = hidden + lookup_rows(table, species_nbr)
    return nn.linear(params["compress"]["2"], torch.nn.functional.silu(hidden))


def _gnn_layer(params, config, layer: int, nodes, messages, geometry, species_nbr, grid, message_table=None):
    """One CartesianTransformer: returns new ``(nodes [n_atoms, d_node], edges [n_kept, d_pet])``.
    ``message_table``: see :func:`_compress`."""
    edges = _compress(params, layer, geometry, species_nbr, messages, message_table)
    # no attention layers (metatrain builds num_attention_layers: 0): no "trans" key
    # survives a round trip through metatrain's flat state dict
    for layer_params in params.get("trans", {}).get("layers", []):
        # inside petfunc.remat the backward pass recomputes the layer's internals
        nodes, edges = remat_call(transformer.layer, layer_params, config, nodes, edges, grid)
    return nodes, edges


def atomic_energies(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """Raw network energies eps_i ``[n_atoms]`` (before scale and composition).

    Per-token layers run on the ``n_kept`` edge tokens and ``n_atoms`` centre tokens
    only; the padded NEF grid is used for attention alone (see
    :func:`petfunc.model.transformer.token_grid`). metatrain runs every layer on the whole
    grid, padding included; its padded keys enter attention with weight ~1e-15, so
    the two agree to round-off.

    Args:
        params: parameter tree of :func:`init`.
        positions: ``[n_atoms, 3]`` Cartesian positions (Å).
        cell: ``[n_structures, 3, 3]`` lattice vectors as rows (zero rows if not periodic).
        neighbors: the integer graph of :mod:`petfunc.graph.neighbors`.
        config: the architecture.
    """
    readout_features, token_factors, centers = _readout_inputs(params, positions, cell, neighbors, config)
    energies = None
    for index, (nodes, edges) in enumerate(readout_features):
        e = _readout(params, config, index, nodes, edges, token_factors, centers)
        energies = e if energies is None else energies + e
    return energies


def last_layer_features(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """Per-atom inputs of the energy's last layers ``[n_atoms, 2 L d_head]``.

    For each readout layer l (L of them), the node head's output and the sum of the
    edge head's outputs over the atom's edges times their cutoff factors: what
    metatrain's ``mtt::aux::energy_last_layer_features`` holds, in its order (per
    layer: node, then edge). The raw energy of atom i is these features times the
    last layers' weights, plus their biases. Summed over a structure's atoms, they
    are what LLPR uncertainties (:mod:`petfunc.llpr`) need.
    """
    readout_features, token_factors, centers = _readout_inputs(params, positions, cell, neighbors, config)
    out = []
    for index, (nodes, edges) in enumerate(readout_features):
        node_hidden = nn.mlp2(params["node_heads"][TARGET][index], nodes, final_activation=True)
        edge_hidden = nn.mlp2(params["edge_heads"][TARGET][index], edges, final_activation=True)
        edge_sum = torch.zeros_like(node_hidden).index_add(0, centers, edge_hidden * token_factors[:, None])
        out += [node_hidden, edge_sum]
    return torch.cat(out, dim=1)


def _check_inputs(params, positions, cell, neighbors: Neighbors, config: PETConfig) -> None:
    """Clear errors for inputs that would otherwise give a cryptic torch error deep in
    the network, or a silently wrong number (positions with an extra row, a cell per
    structure too many, parameters made for other species)."""
    # PyTorch would stop at the first product ("mat1 and mat2 must have the same
    # dtype"), which does not say which input is off
    weight = params["edge_embedder"]["weight"]
    for name, tensor in (("positions", positions), ("cell", cell)):
        if tensor.dtype != weight.dtype or tensor.device != weight.device:
            raise TypeError(
                f"{name}: {tensor.dtype} on {tensor.device}, but the parameters: {weight.dtype} on "
                f"{weight.device}; give both the same dtype and device (from_atoms(..., dtype=, "
                "device=) for the inputs)"
            )
    check_sizes(positions, cell, neighbors)
    n_species = len(config.atomic_types)
    if (
        weight.dim() != 2
        or weight.shape[0] != n_species
        or weight.shape[1] != config.d_pet
        or params["composition_weights"].shape[-1] != n_species
    ):
        raise ValueError(
            f"the parameters are not for this config's {n_species} atomic types {list(config.atomic_types)} "
            f"and d_pet {config.d_pet} "
            f"(edge_embedder.weight {list(weight.shape)}, composition_weights "
            f"{list(params['composition_weights'].shape)}); petfunc.check_params(config, params) names "
            "every mismatch"
        )
    if len(params.get("gnn_layers", [])) != config.num_gnn_layers:
        raise ValueError(
            f"the parameters have {len(params.get('gnn_layers', []))} GNN layers, the config "
            f"{config.num_gnn_layers}; petfunc.check_params(config, params) names every mismatch"
        )


class _Tokens(NamedTuple):
    """The edge geometry of PET's tokens (the kept edges), computed from positions."""

    vectors: torch.Tensor  # [n_edges, 3] every edge of the flat list
    geometry: torch.Tensor  # [n_kept, 4] token vector and length
    factors: torch.Tensor  # [n_kept] cutoff factors
    species_nbr: torch.Tensor  # [n_kept] species index of each token's neighbour
    centers: torch.Tensor  # [n_kept] centre atom of each token
    grid: transformer.TokenGrid  # the tokens' NEF grid for attention


def _tokens(positions, cell, neighbors: Neighbors, config: PETConfig) -> _Tokens:
    vectors = edge_vectors(positions, cell, neighbors)
    distances = torch.linalg.vector_norm(vectors, dim=-1) + 1e-15
    factors = cutoff_factors(config, distances, neighbors)
    kept = neighbors.kept_edges
    token_vectors = vectors[kept]  # [n_kept, 3]
    # metatrain recomputes the length from the NEF vectors: sqrt(|V|^2 + 1e-15)
    token_distances = torch.sqrt((token_vectors**2).sum(dim=1) + 1e-15)
    token_factors = factors[kept]
    centers = neighbors.centers[kept]
    grid = transformer.token_grid(
        neighbors.nef_index, neighbors.nef_mask, neighbors.nef_slot, centers, token_factors
    )
    return _Tokens(
        vectors,
        torch.cat([token_vectors, token_distances[:, None]], dim=1),
        token_factors,
        neighbors.species[neighbors.neighbors[kept]],
        centers,
        grid,
    )


def _gnn_features(params, config: PETConfig, tokens: _Tokens, neighbors: Neighbors):
    """``[(nodes, edge tokens)]`` per readout layer: the feedforward featurizer reads
    out its last layer, the residual one every layer."""
    # the first messages are an embedding of the neighbour's species
    first_messages = params["edge_embedder"]["weight"]  # [n_species, d_pet]
    messages = nn.embedding(params["edge_embedder"], tokens.species_nbr)
    condition = conditioning(params, config, neighbors) if config.system_conditioning else None
    reverse = neighbors.reverse_index
    species = neighbors.species
    layers = params.get("gnn_layers", [])  # none with num_gnn_layers: 0 (feedforward: embeddings read out)
    feedforward = config.featurizer_type == "feedforward"
    readout_features = []
    nodes = nn.embedding(params["node_embedders"][0], species) if feedforward else None
    for index in range(config.num_gnn_layers):
        if not feedforward:  # residual featurizer: fresh node embeddings each layer
            nodes = nn.embedding(params["node_embedders"][index], species)
        nodes, edges = _gnn_layer(
            layers[index],
            config,
            index,
            nodes,
            messages,
            tokens.geometry,
            tokens.species_nbr,
            tokens.grid,
            message_table=first_messages if index == 0 else None,
        )
        if condition is not None:
            nodes = nodes + condition
        if feedforward:
            # reverse is an involution of the tokens: its adjoint is itself
            reversed_edges = permute_rows(edges, reverse, reverse)
            mixed = nn.layer_norm(
                params["combination_norms"][index], torch.cat([edges, reversed_edges], dim=1)
            )
            messages = messages + edges + nn.mlp2(params["combination_mlps"][index], mixed)
        else:
            readout_features.append((nodes, edges))
            messages = 0.5 * (messages + permute_rows(edges, reverse, reverse))
    if feedforward:
        readout_features.append((nodes, messages))
    return readout_features


def _readout_inputs(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """``([(nodes, edge tokens)] per readout layer, token cutoff factors, token centres)``."""
    _check_inputs(params, positions, cell, neighbors, config)
    tokens = _tokens(positions, cell, neighbors, config)
    readout_features = _gnn_features(params, config, tokens, neighbors)
    if config.long_range.enable:
        # the real-space term runs over the whole list within the cutoff (the list
        # metatrain hands torch-pme), not the adaptive-cutoff subset
        extra = long_range.features(
            params["long_range_featurizer"],
            config,
            [nodes for nodes, _ in readout_features],
            positions,
            cell,
            neighbors,
            neighbors.centers,
            neighbors.neighbors,
            torch.sqrt((tokens.vectors**2).sum(dim=1) + 1e-15),
        )
        readout_features = [((nodes + extra) * 0.5**0.5, edges) for nodes, edges in readout_features]
    return readout_features, tokens.factors, tokens.centers


def _structure_sum(values: torch.Tensor, structure_index: torch.Tensor, n_structures: int):
    # scatter_add into a fresh buffer: index_add crashes inductor on CPU when S == 1
    out = torch.zeros(n_structures, dtype=values.dtype, device=values.device)
    return out.scatter_add(0, structure_index, values)


def energy_terms(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """``(energy [n_structures], per-atom energies [n_atoms])`` in eV from one pass.

    ``E_s = c * sum_{i in s} eps_i + sum_{i in s} w_{Z_i}`` (+ ZBL) is metatrain's
    evaluation-mode output; the per-atom energies ``c eps_i + w_{Z_i}`` (+ half of
    each ZBL pair) sum to it up to round-off. Traced code that needs only one of
    them loses the other to dead-code elimination.
    """
    raw = atomic_energies(params, positions, cell, neighbors, config)
    n_structures = cell.shape[0]
    sidx = neighbors.structure_index
    scale = params["energy_scale"].to(raw.dtype)
    weights = params["composition_weights"].to(raw.dtype)[neighbors.species]
    total = scale * _structure_sum(raw, sidx, n_structures) + _structure_sum(weights, sidx, n_structures)
    per_atom = scale * raw + weights
    if config.zbl:
        repulsion = zbl.atomic_energies(positions, cell, neighbors, config)
        total = total + _structure_sum(repulsion, sidx, n_structures)
        per_atom = per_atom + repulsion
    return total, per_atom


def per_atom_energies(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """Energies per atom ``[n_atoms]`` in eV: c eps_i + w_{Z_i} (+ half the ZBL pairs)."""
    return energy_terms(params, positions, cell, neighbors, config)[1]


def energy(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """Total energy of each structure ``[n_structures]`` (eV).

    ``E_s = c * sum_{i in s} eps_i + sum_{i in s} w_{Z_i}`` (+ ZBL), metatrain's
    evaluation-mode output. See :func:`atomic_energies` for the arguments.
    """
    return energy_terms(params, positions, cell, neighbors, config)[0]


def raw_energy(params, positions, cell, neighbors: Neighbors, config: PETConfig):
    """Network energy per structure ``sum eps_i`` ``[n_structures]``, in units of the
    energy scale, without composition or ZBL: metatrain's training-mode output."""
    raw = atomic_energies(params, positions, cell, neighbors, config)
    return _structure_sum(raw, neighbors.structure_index, cell.shape[0])


class PET:
    """A PET architecture bound to its config. Holds no tensors; all methods are pure.

    >>> model = PET(PETConfig(atomic_types=(1, 6, 7, 8)))
    >>> params = model.init(seed=0)
    >>> energy = model.energy(params, positions, cell, neighbors)
    """

    #: the methods that evaluate the model: ``method(params, positions, cell, neighbors)``
    EVALUATIONS = ("energy", "energy_terms", "per_atom_energies", "raw_energy")

    def __init__(self, config: PETConfig):
        if not isinstance(config, PETConfig):
            raise TypeError(f"PET needs a PETConfig, got {type(config).__name__}")
        self.config = config

    def __repr__(self) -> str:
        return f"PET({self.config!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, PET) and other.config == self.config

    def __hash__(self) -> int:
        return hash(self.config)

    def init(self, seed: int = 0, dtype=torch.float32, device=None, generator=None):
        """See :func:`petfunc.model.init`."""
        return init(self.config, seed=seed, dtype=dtype, device=device, generator=generator)

    def energy(self, params, positions, cell, neighbors):
        """Total energies ``[n_structures]`` (eV); see :func:`petfunc.model.energy`."""
        return energy(params, positions, cell, neighbors, self.config)

    def energy_terms(self, params, positions, cell, neighbors):
        """``(energies [n_structures], per-atom energies [n_atoms])`` from one pass (eV)."""
        return energy_terms(params, positions, cell, neighbors, self.config)

    def per_atom_energies(self, params, positions, cell, neighbors):
        """Energies per atom ``[n_atoms]`` (eV)."""
        return per_atom_energies(params, positions, cell, neighbors, self.config)

    def raw_energy(self, params, positions, cell, neighbors):
        """Training-mode network energy ``[n_structures]`` (units of the energy scale)."""
        return raw_energy(params, positions, cell, neighbors, self.config)
