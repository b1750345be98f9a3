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


# Where compilers are known to give P3M's strain derivative (hence stress) right.
# Inductor on the CPU: always (compiled == eager on random long-range models and
# batches, in the slow tests). Torch 2.11's inductor fused the per-structure loop of
# potentials() wrongly (stress off by about 100 %); _signed_volume and the loop's
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


def _coulomb_kernel(k_sq: torch.Tensor, sigma: float) -> torch.Tensor:
    """4 pi exp(-sigma^2 k^2 / 2) / k^2, and 0 at k = 0 (grad-safe)."""
    zero = k_sq == 0
    safe = torch.where(zero, torch.ones_like(k_sq), k_sq)
    return torch.where(zero, torch.zeros_like(k_sq), 4 * math.pi * torch.exp(-0.5 * sigma**2 * safe) / safe)


def _cross(u, v):
    """``u x v`` over the last axis, in plain arithmetic (``torch.linalg.cross``'s
    vmap rule reads integer sizes in torch 2.11, which breaks symbolic traces)."""
    u1, u2, u3 = u.unbind(-1)
    v1, v2, v3 = v.unbind(-1)
    return torch.stack([u2 * v3 - u3 * v2, u3 * v1 - u1 * v3, u1 * v2 - u2 * v1], dim=-1)


def _inverse(cell):
    """Inverse of ``cell [..., 3, 3]`` (rows a, b, c): columns (b x c, c x a, a x b) / V.

    Not ``torch.linalg.inv``: in torch 2.11 its backward calls ``matmul`` in a
    way that cannot be traced with symbolic sizes under ``vmap`` (ensembles), and
    this closed form is plain arithmetic to every order of differentiation.
    """
    a, b, c = cell.unbind(-2)
    cofactors = torch.stack([_cross(b, c), _cross(c, a), _cross(a, b)], dim=-1)
    return cofactors / _signed_volume(cell)[..., None, None]


def _signed_volume(cell):
    """``a . (b x c)`` of ``cell [..., 3, 3]`` (rows a, b, c), i.e. its determinant.

    Not ``torch.linalg.det``: torch 2.11 cannot trace det's backward on fake
    tensors (an internal assert), which petfunc.compile needs. The rows come from
    ``unbind`` (backward: one stack), not three selects (backward: select_scatter):
    torch 2.11's inductor fused that select_scatter with a later add wrongly, and
    P3M's strain derivative came out about 100 % off.
    """
    a, b, c = cell.unbind(-2)
    return (a * _cross(b, c)).sum(-1)


def _corrections(q, volume, sigma: float):
    """Self term and neutralising background that torch-pme adds to the
    reciprocal-space potential. ``q [S, A, C]`` (zero on padding), ``volume [S]``;
    returns ``[S, A, C]``."""
    total = q.sum(dim=1, keepdim=True)  # [S, 1, C]
    out = -q * ((2 / math.pi) ** 0.5 / sigma)
    return out - 2 * (math.pi * sigma**2) * total / volume[:, None, None]


def _ewald(q, positions, cell, kgrid, volume, sigma: float):
    """Reciprocal-space potential ``[S, A, C]`` (before the 1/2) of every structure."""
    inverse_t = _inverse(cell).transpose(1, 2)
    k = 2 * math.pi * torch.einsum("ski,sib->skb", kgrid.to(cell.dtype), inverse_t)  # [S, K, 3]
    kernel = _coulomb_kernel((k**2).sum(dim=2), sigma)  # [S, K]
    phase = torch.einsum("skb,sab->ska", k, positions)  # [S, K, A]
    cos, sin = torch.cos(phase), torch.sin(phase)
    structure_cos = torch.einsum("ska,sac->skc", cos, q) * kernel[:, :, None]
    structure_sin = torch.einsum("ska,sac->skc", sin, q) * kernel[:, :, None]
    potential = torch.einsum("ska,skc->sac", cos, structure_cos) + torch.einsum(
        "ska,skc->sac", sin, structure_sin
    )
    return potential / volume[:, None, None] + _corrections(q, volume, sigma)


def _assignment_weights(x: torch.Tensor, order: int) -> torch.Tensor:
    """``[order, ...]`` P3M charge-assignment weights of offsets ``x`` in [-1/2, 1/2]
    (Hockney-Eastwood B-splines, as torch-pme's ``MeshInterpolator``)."""
    if order == 1:
        return torch.ones_like(x)[None]
    if order == 2:
        return torch.stack([0.5 * (1 - 2 * x), 0.5 * (1 + 2 * x)])
    x2 = x * x
    if order == 3:
        return torch.stack([1 / 8 * (1 - 4 * x + 4 * x2), 1 / 4 * (3 - 4 * x2), 1 / 8 * (1 + 4 * x + 4 * x2)])
    x3 = x * x2
    if order == 4:
        return torch.stack(
            [
                1 / 48 * (1 - 6 * x + 12 * x2 - 8 * x3),
                1 / 48 * (23 - 30 * x - 12 * x2 + 24 * x3),
                1 / 48 * (23 + 30 * x - 12 * x2 - 24 * x3),
                1 / 48 * (1 + 6 * x + 12 * x2 + 8 * x3),
            ]
        )
    x4 = x * x3
    return torch.stack(
        [
            1 / 384 * (1 - 8 * x + 24 * x2 - 32 * x3 + 16 * x4),
            1 / 96 * (19 - 44 * x + 24 * x2 + 16 * x3 - 16 * x4),
            1 / 192 * (115 - 120 * x2 + 48 * x4),
            1 / 96 * (19 + 44 * x + 24 * x2 - 16 * x3 - 16 * x4),
            1 / 384 * (1 + 8 * x + 24 * x2 + 32 * x3 + 16 * x4),
        ]
    )


def _axis_frequencies(n, dtype, device) -> torch.Tensor:
    m = torch.arange(n, dtype=dtype, device=device)
    return torch.where(m < (n + 1) // 2, m, m - n)


def _p3m_frequencies(nx, ny, nz, dtype, device):
    """Integer frequencies of each bin of a P3M spectrum, as torch-pme's transform
    reads them: ``([nx, nz], [ny, nz], [nz])`` along the three cell vectors.

    torch-pme filters the half spectrum of ``rfftn`` (z frequencies 0..nz/2, x and y
    in FFT order, whose Nyquist bin is -n/2) and inverts it with ``irfftn``, which
    completes the other half by conjugate symmetry. petfunc transforms the whole
    spectrum (see :func:`_p3m`), so it filters each bin of the other half (z index
    above nz/2) with the kernel of its mirror bin, by evenness the kernel at minus
    the mirror's frequencies: there the x and y Nyquist bins read +n/2. In a
    triclinic cell the kernel at +n/2 and at -n/2 differ, and with a small smearing
    the Nyquist bins count: read all at -n/2, the forces of a triclinic cell at
    smearing 0.5 differed from metatrain's by 5e-6 (relative).
    """
    iz = torch.arange(nz, device=device)
    upper = iz * 2 > nz  # the z half that irfftn fills by symmetry
    fz = _axis_frequencies(nz, dtype, device)
    fz = torch.where(iz * 2 == nz, -fz, fz)  # rfftn's z Nyquist is +nz/2

    def mirrored(n):
        i = torch.arange(n, device=device)
        f = _axis_frequencies(n, dtype, device)[:, None]
        return torch.where((i * 2 == n)[:, None] & upper[None, :], -f, f)

    return mirrored(nx), mirrored(ny), fz


def _p3m(q, positions, cell, sizes, mesh, volume, sigma: float, order: int):
    """Reciprocal-space potential ``[A, C]`` (before the 1/2) of one structure by P3M.

    ``q [A, C]``, ``positions [A, 3]``, ``cell [3, 3]``, ``sizes [3]`` (integer mesh
    sizes), ``mesh`` a tensor of the mesh's shape.
    """
    nx, ny, nz = mesh.shape
    channels = q.shape[1]
    dtype, device = positions.dtype, positions.device
    # charge assignment: the ``order`` nearest mesh points along each axis
    scaled = sizes.to(dtype) * (positions @ _inverse(cell))  # [A, 3] in mesh units
    if order % 2 == 0:
        base = torch.floor(scaled).to(torch.long)
        offset = scaled - (base + 0.5)
    else:
        base = torch.round(scaled).to(torch.long)
        offset = scaled - base
    weights = _assignment_weights(offset, order)  # [order, A, 3]
    steps = torch.arange(1 - (order + 1) // 2, 1 + order // 2, device=device)
    points = (base[None] + steps[:, None, None]) % sizes  # [order, A, 3]
    ix = points[:, None, None, :, 0]
    iy = points[None, :, None, :, 1]
    iz = points[None, None, :, :, 2]
    flat = ((ix * ny + iy) * nz + iz).reshape(-1)  # [order^3 * A]
    w = (weights[:, None, None, :, 0] * weights[None, :, None, :, 1] * weights[None, None, :, :, 2]).reshape(
        -1, q.shape[0]
    )
    values = (w[None] * q.T[:, None, :]).reshape(channels, -1)  # [C, order^3 * A]
    # zeros shaped from ``mesh`` rather than from its sizes: a factory call whose size
    # is a product of symbolic sizes does not survive reloading a pickled trace
    rho = torch.zeros_like(mesh, dtype=dtype).reshape(1, -1).repeat(channels, 1)
    rho = rho.scatter_add(1, flat[None].expand(channels, -1), values).reshape(channels, nx, ny, nz)

    # the P3M filter: Coulomb kernel divided by the squared assignment transform, in
    # float64 whatever the model's dtype: near the zeros of the sinc, u2 (a 2p-th
    # power) is tiny, and the derivative of 1/u2 with respect to the cell (-1/u2^2)
    # overflows float32, which made float32 stresses NaN on some triclinic cells (as
    # in torch-pme); the kernel itself is small there and fits any dtype
    wide = torch.float64
    cell64 = cell.to(wide)
    reciprocal = 2 * math.pi * _inverse(cell64).T  # rows b_a
    fx, fy, fz = _p3m_frequencies(nx, ny, nz, wide, device)
    k = (
        fx[:, None, :, None] * reciprocal[0]
        + fy[None, :, :, None] * reciprocal[1]
        + fz[None, None, :, None] * reciprocal[2]
    )  # [nx, ny, nz, 3]
    k_sq = torch.linalg.vector_norm(k, dim=3) ** 2
    spacing = torch.linalg.vector_norm(cell64, dim=1) / sizes.to(wide)
    u2 = torch.prod(torch.sinc(k * spacing / (2 * math.pi)), dim=-1) ** (2 * order)
    zero = u2 == 0
    influence = torch.where(zero, torch.zeros_like(u2), 1 / torch.where(zero, torch.ones_like(u2), u2))
    kernel = (influence * _coulomb_kernel(k_sq, sigma)).to(dtype)
    # complex transforms of the whole spectrum, not rfftn/irfftn: the derivative of
    # irfftn doubles the frequencies strictly inside the half spectrum, a slice whose
    # size (n_c - n_c // 2 - 1) a trace guards against being 0 or 1, so a compiled or
    # exported P3M would take only meshes in the example's case (n_c = 2, 4, or >= 8).
    # The kernel reads each bin as irfftn would (_p3m_frequencies): torch-pme's numbers
    potential_mesh = torch.fft.ifftn(
        torch.fft.fftn(rho, norm="backward", dim=(1, 2, 3)) * kernel, norm="forward", dim=(1, 2, 3)
    ).real
    at_atoms = (
        (potential_mesh.reshape(channels, -1)[:, flat].reshape(channels, -1, q.shape[0]) * w[None])
        .sum(dim=1)
        .T
    )
    return at_atoms / volume + _corrections(q[None], volume[None], sigma)[0]


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
    volume = torch.abs(_signed_volume(safe_cell))
    mask = inputs.structure_mask.to(dtype)[:, :, None]
    q_slots = charges[inputs.structure_atoms] * mask  # [S, A, C]
    x_slots = positions[inputs.structure_atoms]  # [S, A, 3]
    if len(inputs.meshes) == 0:
        kspace = _ewald(q_slots, x_slots, safe_cell, inputs.kgrid, volume, sigma)
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
                    _p3m(q_s, x_s, cell_s, sizes_s, mesh, volume_s, sigma, lr.interpolation_nodes)
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
