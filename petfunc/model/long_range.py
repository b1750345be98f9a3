"""PET's long-range features: Coulomb potentials of learned charges (metatrain's
``LongRangeFeaturizer`` on torch-pme), as pure functions.

Each atom carries ``d_node`` learned "charges" q_i = Lin(h_bar_i). Their Coulomb
potential, with the part inside the PET cutoff r_c smoothly removed, is

    V_i = 1/2 sum_j q_j v(r_ij),

computed per structure by one of three methods, exactly as torch-pme computes it:

* **Ewald** (periodic; what metatrain trains with): a real-space sum over the PET
  edges of ``-erf(r / (sigma sqrt 2)) / r * f_c(r)`` plus a reciprocal-space sum over
  every k = 2 pi m @ cell^-T on the integer grid ``|m_a| <= ceil(|a| / lambda)``, minus
  the self term and the neutralising background.
* **P3M** (periodic; what metatrain evaluates with): the same, with the
  reciprocal-space sum done by assigning charges to a mesh (``interpolation_nodes``
  order), FFT, the P3M influence function, and interpolating back.
* **direct** (non-periodic): ``1/r (1 - f_c(r))`` over all pairs of atoms.

Here sigma is ``smearing``, lambda ``kspace_resolution``, and
f_c(r) = (1 + cos(pi r / r_c)) / 2 for r < r_c (0 beyond) with r_c the PET cutoff.
The features are ``out_projection(V)`` (Lin, SiLU, Lin); every readout node feature
becomes ``(h + features) / sqrt 2``.

The k-vector grids, meshes, pair lists and the per-structure atom layout depend on
the data, so :func:`petfunc.graph.long_range.build` makes them eagerly (integers
only). Everything that depends on positions or the cell (k-vectors, volume, mesh
weights, distances) is computed in :func:`potentials`, so forces and stress from
``torch.func.grad`` are exact.
"""

from __future__ import annotations

import math
import warnings

import torch

from petfunc import tree
from petfunc.compile import register_input_check
from petfunc.config import PETConfig
from petfunc.graph import LeadingMeshes, LongRange, Neighbors, mesh_layout
from petfunc.model import nn
from petfunc.model.reciprocal import ewald, p3m, signed_volume


# Where compilers are known to give P3M's strain derivative (hence stress) right.
# Inductor on the CPU: always (compiled == eager on random long-range models and
# batches, in the slow tests). Torch 2.11's inductor fused the per-structure loop of
# potentials() wrongly (stress off by about 100 %); reciprocal.signed_volume and the loop's
# shape avoid those fusions, which is verified on the CPU only, so on a GPU inductor
# is trusted from torch 2.13. AOTInductor builds from torch.export's graph and gets
# the strain derivative wrong on torch < 2.13. Hence: on a GPU with torch < 2.13
# petfunc.compile refuses inductor for P3M inputs and the compiled calculators take
# aot_eager; with torch < 2.13 petfunc export leaves AOTInductor out.
_TORCH = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
P3M_INDUCTOR_GPU_CORRECT = _TORCH >= (2, 13)
P3M_AOTI_CORRECT = _TORCH >= (2, 13)


def p3m_inductor_correct(device) -> bool:
    """Whether inductor's P3M graphs (``petfunc.compile``) are known right on
    ``device`` with this torch: on the CPU always, on a GPU from torch 2.13
    (:data:`P3M_INDUCTOR_GPU_CORRECT`). AOTInductor: :data:`P3M_AOTI_CORRECT`."""
    return torch.device(device).type == "cpu" or P3M_INDUCTOR_GPU_CORRECT


def calculator_backend(config: PETConfig, backend: str, device="cpu") -> str:
    """The backend a compiled calculator of ``config`` on ``device`` uses when asked
    for ``backend``: ``aot_eager`` (with a warning) instead of inductor for a
    long-range model where not :func:`p3m_inductor_correct`, else ``backend``."""
    if backend == "inductor" and config.long_range.enable and not p3m_inductor_correct(device):
        warnings.warn(
            "torch < 2.13 on a GPU: compiling this long-range model with aot_eager, not "
            "inductor, whose P3M strain derivative (stress) was wrong on torch 2.11 and "
            "is not checked there since",
            stacklevel=3,
        )
        return "aot_eager"
    return backend


# ---------------------------------------------------------------------------------------
# eager inputs


# ---------------------------------------------------------------------------------------
# parameters


def init(config: PETConfig, generator, dtype, device):
    """``charges_map`` Linear(d_node, d_node) and ``out_projection`` (Lin, SiLU, Lin),
    metatrain's ``long_range_featurizer`` weights."""
    dn = config.d_node
    return {
        "charges_map": nn.init_linear(dn, dn, generator, dtype, device),
        "out_projection": nn.init_mlp2(dn, dn, dn, generator, dtype, device),
    }


# ---------------------------------------------------------------------------------------
# the potentials


def _exclusion(r: torch.Tensor, r_c: float) -> torch.Tensor:
    """torch-pme's cutoff f_c(r) = 1 - ((1 - cos(pi r / r_c)) / 2) below r_c, else 0."""
    inside = 1 - (1 - torch.cos(math.pi * (r / r_c))) * 0.5
    return torch.where(r < r_c, inside, torch.zeros_like(r))


def _row_sum(like: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """``out[index[e]] += rows[e]`` into zeros shaped like ``like [n, C]``.

    scatter_add, not index_add: inductor miscompiles index_add in some batched and
    size-1 cases (an inductor CPU codegen assert with one row)."""
    return torch.zeros_like(like).scatter_add(0, index[:, None].expand_as(rows), rows)


def potentials(
    config: PETConfig, charges, positions, cell, neighbors, edge_centers, edge_neighbors, edge_distances
):
    """Coulomb potentials ``[n_atoms, C]`` of the learned ``charges [n_atoms, C]``.

    ``edge_*`` is the full neighbour list (edges beyond the PET cutoff add exactly
    zero): the real-space Ewald/P3M term. ``neighbors.long_range`` chooses Ewald or
    P3M (see :func:`build`).
    """
    inputs: LongRange = neighbors.long_range
    if inputs is None:
        raise ValueError(
            "this model has long-range features but its neighbors carry no long-range "
            "inputs: build them with petfunc.from_atoms or collate for this config"
        )
    lr = config.long_range
    sigma, r_c = lr.smearing, config.cutoff
    channels = charges.shape[1]
    dtype = charges.dtype
    sidx = neighbors.structure_index
    structure_periodic = inputs.periodic  # [S]
    atom_periodic = structure_periodic[sidx]  # [n_atoms]

    # non-periodic structures: direct sum over all pairs
    i, j = inputs.pairs[:, 0], inputs.pairs[:, 1]
    pair_weight = inputs.pair_mask.to(dtype)
    # padding pairs get r = 1 (a finite gradient) and weight 0; real pairs are exact
    r = torch.sqrt(((positions[j] - positions[i]) ** 2).sum(dim=1) + (1 - pair_weight))
    v = (1.0 / r.clamp(min=1e-15)) * (1 - _exclusion(r, r_c)) * pair_weight
    direct = _row_sum(charges, i, charges[j] * v[:, None]) + _row_sum(charges, j, charges[i] * v[:, None])

    # periodic structures: real-space part over the neighbour list ...
    edge_periodic = atom_periodic[edge_centers]
    lr_part = torch.erf(edge_distances / sigma / 2.0**0.5) / edge_distances.clamp(min=1e-12)
    v_sr = -lr_part * _exclusion(edge_distances, r_c) * edge_periodic.to(dtype)
    real = _row_sum(charges, edge_centers, charges[edge_neighbors] * v_sr[:, None])

    # ... and the reciprocal-space part, on the [S, max_atoms] structure layout
    # (non-periodic structures get the identity cell so nothing is singular; their
    # atoms are masked out below)
    eye = torch.eye(3, dtype=cell.dtype, device=cell.device).expand_as(cell)
    safe_cell = torch.where(structure_periodic[:, None, None], cell, eye)
    volume = torch.abs(signed_volume(safe_cell))
    mask = inputs.structure_mask.to(dtype)[:, :, None]
    q_slots = charges[inputs.structure_atoms] * mask  # [S, A, C]
    x_slots = positions[inputs.structure_atoms]  # [S, A, 3]
    if len(inputs.meshes) == 0:
        kspace = ewald(q_slots, x_slots, safe_cell, inputs.kgrid, volume, sigma)
    else:
        per_structure = []
        # each structure's rows by unbind (backward: a stack), not by indexing
        # (backward: select_scatter): torch 2.13's inductor fused the sum of the cell
        # gradient's parts of a lone crystal into a kernel that ran before the part
        # from the edge vectors (an index_put) was accumulated; strain derivative
        # about 100 % off
        n = len(inputs.meshes)
        rows = zip(*(t[:n].unbind(0) for t in (q_slots, x_slots, safe_cell, inputs.mesh_sizes, volume)))
        for mesh, (q_s, x_s, cell_s, sizes_s, volume_s) in zip(inputs.meshes, rows):
            if mesh is None:
                per_structure.append(torch.zeros_like(q_s))
            else:
                per_structure.append(
                    p3m(q_s, x_s, cell_s, sizes_s, mesh, volume_s, sigma, lr.interpolation_nodes)
                )
        kspace = torch.stack(per_structure)
        if isinstance(inputs.meshes, LeadingMeshes):
            # the later structures' part is zero (slice_scatter: no size S - len, which
            # a trace would guard against being 1)
            kspace = torch.zeros_like(q_slots).slice_scatter(kspace, dim=0, start=0, end=len(inputs.meshes))
    kspace = kspace.reshape(-1, channels)[inputs.atom_slot]
    periodic_part = (real + kspace) * atom_periodic.to(dtype)[:, None]
    return 0.5 * (direct + periodic_part)


def features(
    params,
    config: PETConfig,
    readout_nodes,
    positions,
    cell,
    neighbors,
    edge_centers,
    edge_neighbors,
    edge_distances,
):
    """Long-range features ``[n_atoms, d_node]`` from the readout node features.

    ``h_bar = sum_r h_r / sqrt(R)`` over the R readout layers, charges
    ``q = charges_map(h_bar)``, features ``out_projection(V(q))``.
    """
    h_bar = torch.stack(readout_nodes).sum(dim=0) * (1 / len(readout_nodes)) ** 0.5
    charges = nn.linear(params["charges_map"], h_bar)
    potential = potentials(
        config, charges, positions, cell, neighbors, edge_centers, edge_neighbors, edge_distances
    )
    return nn.mlp2(params["out_projection"], potential)


def has_p3m_inputs(args) -> bool:
    """Whether ``args`` hold the long-range inputs of a P3M batch with a mesh."""

    def is_neighbors(x):
        return isinstance(x, Neighbors)

    return any(
        any(mesh_layout(x.long_range) or ())
        for x in tree.tree_leaves(args, is_leaf=is_neighbors)
        if is_neighbors(x)
    )


def refuse_p3m_inductor(example_args, backend) -> None:
    """The input check of :func:`petfunc.compile` for P3M: inductor is refused for
    P3M inputs on devices where it is not known right (:func:`p3m_inductor_correct`)."""
    devices = {x.device for x in tree.tree_leaves(example_args) if isinstance(x, torch.Tensor)}
    if (
        backend == "inductor"
        and not all(p3m_inductor_correct(d) for d in devices)
        and has_p3m_inputs(example_args)
    ):
        raise ValueError(
            "inductor of torch < 2.13 is not known to compile the derivative of P3M "
            "long-range features with respect to the cell right on a GPU (torch 2.11 "
            "miscompiled it: strain derivatives, hence stresses, wrong by 100 %; avoided "
            "since, but checked on the CPU only): use backend='aot_eager', Ewald inputs "
            "(from_atoms(..., long_range='ewald')), the CPU, or torch >= 2.13"
        )


register_input_check(refuse_p3m_inductor)
