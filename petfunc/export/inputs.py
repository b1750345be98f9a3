"""The inputs of an exported model: their names, their order, and how a batch's
:class:`~petfunc.graph.Neighbors` becomes them (see :mod:`petfunc.export`)."""

from __future__ import annotations

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.graph import LeadingMeshes, LongRange, Neighbors, long_range
from petfunc.structures import collate_padded, prepare


# the inputs of every model; long-range models take LONG_RANGE_INPUTS after them
INPUTS = ("positions", "cell") + tuple(f for f in Neighbors._fields if f != "long_range")


N_GRAPH_FIELDS = len(INPUTS) - 2


_LR_COMMON = ("lr_structure_atoms", "lr_structure_mask", "lr_atom_slot", "lr_periodic")


_LR_PAIRS = ("lr_pairs", "lr_pair_mask")


LONG_RANGE_INPUTS = {
    "p3m": _LR_COMMON + ("lr_mesh_sizes", "lr_mesh") + _LR_PAIRS,
    "ewald": _LR_COMMON + ("lr_kgrid",) + _LR_PAIRS,
}


OUTPUTS = ("energy", "energies", "forces", "strain_derivative")


def input_names(long_range: str | None) -> tuple[str, ...]:
    """The artifact's input names, for long-range method ``long_range`` (None: a
    model without long-range features)."""
    return INPUTS + (LONG_RANGE_INPUTS[long_range] if long_range else ())


def method_of(config: PETConfig, long_range: str | None) -> str | None:
    """The long-range method of an export: None without long-range features."""
    if not config.long_range.enable:
        return None
    method = "p3m" if long_range is None else long_range
    if method not in LONG_RANGE_INPUTS:
        raise ValueError(f"long_range must be one of {tuple(LONG_RANGE_INPUTS)}, got {long_range!r}")
    return method


def example_inputs(config: PETConfig, dtype, device, long_range: str | None = None):
    """A batch whose sizes are all >= 2 and mostly distinct: a cluster and the padding
    molecule, after a small triclinic crystal for long-range models (whose k-grid or
    P3M mesh needs a periodic first structure)."""
    rng = np.random.default_rng(0)
    n = 5
    # a compact cluster (every pair within the cutoff), all species represented
    positions = rng.uniform(0.0, 0.35 * config.cutoff, size=(n, 3))
    numbers = [config.atomic_types[i % len(config.atomic_types)] for i in range(n)]
    structures = [prepare(numbers, positions, None, False, config, "example")]
    if long_range:
        cell = np.array([[4.1, 0.0, 0.0], [0.4, 4.7, 0.0], [0.3, 0.6, 5.3]]) * max(1.0, config.cutoff / 4.5)
        fractions = rng.uniform(0.0, 1.0, size=(n + 1, 3))
        numbers = [config.atomic_types[i % len(config.atomic_types)] for i in range(n + 1)]
        crystal = prepare(numbers, fractions @ cell, cell, True, config, "example crystal")
        structures.insert(0, crystal)
    inputs = collate_padded(
        structures, config, always=True, dtype=dtype, device=device, long_range=long_range or "p3m"
    )
    return inputs[:3]


# the mesh input when the first structure is a molecule (its k-space part is masked out)
_STAND_IN_MESH = (2, 2, 2)


def long_range_inputs(
    neighbors: Neighbors, cell: torch.Tensor, config: PETConfig, method: str
) -> tuple[torch.Tensor, ...]:
    """The long-range inputs of an artifact for ``method`` (in ``LONG_RANGE_INPUTS``
    order), from a batch's :class:`Neighbors`. Inputs built for the other method are
    rebuilt from the batch's cells, periodicity and atom counts.

    Raises:
        ValueError: no long-range inputs, or (P3M) a periodic structure other than the first.
    """
    inputs = neighbors.long_range
    if inputs is None:
        raise ValueError(
            "this exported model has long-range features but the neighbors carry no "
            "long-range inputs: build them with petfunc.from_atoms or collate for its config"
        )
    periodic = inputs.periodic.cpu()
    if method == "p3m" and bool(periodic[1:].any()):
        raise ValueError(
            "this exported model evaluates long-range features with P3M, whose meshes "
            "can differ per structure: only the first structure of a call may be "
            f"periodic, but structures {periodic.nonzero().flatten().tolist()} are. Call it once per "
            "crystal, or export with long_range='ewald' to batch crystals"
        )
    built_for = "ewald" if len(inputs.meshes) == 0 else "p3m"
    if built_for != method:
        counts = inputs.structure_mask.sum(dim=1).cpu().tolist()
        cells = cell.detach().cpu().double().numpy()
        pbcs = periodic.numpy()[:, None].repeat(3, axis=1)
        inputs = long_range.build(config, counts, cells, pbcs, method=method, device=inputs.periodic.device)
    common = (inputs.structure_atoms, inputs.structure_mask, inputs.atom_slot, inputs.periodic)
    pairs = (inputs.pairs, inputs.pair_mask)
    if method == "ewald":
        return common + (inputs.kgrid,) + pairs
    mesh, mesh_sizes = inputs.meshes[0], inputs.mesh_sizes
    if mesh is None:
        # a molecule first: a stand-in mesh, whose result is masked out
        mesh = torch.zeros(_STAND_IN_MESH, dtype=torch.uint8, device=mesh_sizes.device)
        mesh_sizes = mesh_sizes.clone()
        mesh_sizes[0] = torch.tensor(_STAND_IN_MESH)
    return common + (mesh_sizes, mesh) + pairs


def long_range_from_inputs(method: str | None, fields):
    """The :class:`petfunc.graph.LongRange` inside the traced function."""
    if method is None:
        return None
    atoms, mask, slot, periodic = fields[:4]
    pairs, pair_mask = fields[-2:]
    if method == "ewald":
        return LongRange(atoms, mask, slot, periodic, fields[4], None, (), pairs, pair_mask)
    # P3M for the first structure only; the others are molecules (their k-space part is zero)
    return LongRange(
        atoms, mask, slot, periodic, None, fields[4], LeadingMeshes((fields[5],)), pairs, pair_mask
    )


def is_fixed(name: str, dim: int) -> bool:
    """The fixed-size axes: the 3 of xyz, of cell vectors, of k-vectors and of mesh
    sizes, and the 2 atoms of a long-range pair."""
    if name == "cell":
        return dim > 0
    if name in ("positions", "cell_shifts", "lr_mesh_sizes", "lr_pairs"):
        return dim == 1
    return name == "lr_kgrid" and dim == 2
