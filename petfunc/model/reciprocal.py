"""The reciprocal-space parts of the long-range Coulomb sums, as torch-pme computes
them: Ewald's sum over k-vectors and P3M's mesh (charge assignment, FFT, influence
function, interpolation back), with the cell's inverse, volume and the self and
background corrections they share. Everything is a function of positions and the
cell, inside the differentiated energy (see :mod:`petfunc.model.long_range`)."""

from __future__ import annotations

import math

import torch


def coulomb_kernel(k_sq: torch.Tensor, sigma: float) -> torch.Tensor:
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


def inverse_cell(cell):
    """Inverse of ``cell [..., 3, 3]`` (rows a, b, c): columns (b x c, c x a, a x b) / V.

    Not ``torch.linalg.inv``: in torch 2.11 its backward calls ``matmul`` in a
    way that cannot be traced with symbolic sizes under ``vmap`` (ensembles), and
    this closed form is plain arithmetic to every order of differentiation.
    """
    a, b, c = cell.unbind(-2)
    cofactors = torch.stack([_cross(b, c), _cross(c, a), _cross(a, b)], dim=-1)
    return cofactors / signed_volume(cell)[..., None, None]


def signed_volume(cell):
    """``a . (b x c)`` of ``cell [..., 3, 3]`` (rows a, b, c), i.e. its determinant.

    Not ``torch.linalg.det``: torch 2.11 cannot trace det's backward on fake
    tensors (an internal assert), which petfunc.compile needs. The rows come from
    ``unbind`` (backward: one stack), not three selects (backward: select_scatter):
    torch 2.11's inductor fused that select_scatter with a later add wrongly, and
    P3M's strain derivative came out about 100 % off.
    """
    a, b, c = cell.unbind(-2)
    return (a * _cross(b, c)).sum(-1)


def corrections(q, volume, sigma: float):
    """Self term and neutralising background that torch-pme adds to the
    reciprocal-space potential. ``q [S, A, C]`` (zero on padding), ``volume [S]``;
    returns ``[S, A, C]``."""
    total = q.sum(dim=1, keepdim=True)  # [S, 1, C]
    out = -q * ((2 / math.pi) ** 0.5 / sigma)
    return out - 2 * (math.pi * sigma**2) * total / volume[:, None, None]


def ewald(q, positions, cell, kgrid, volume, sigma: float):
    """Reciprocal-space potential ``[S, A, C]`` (before the 1/2) of every structure."""
    inverse_t = inverse_cell(cell).transpose(1, 2)
    k = 2 * math.pi * torch.einsum("ski,sib->skb", kgrid.to(cell.dtype), inverse_t)  # [S, K, 3]
    kernel = coulomb_kernel((k**2).sum(dim=2), sigma)  # [S, K]
    phase = torch.einsum("skb,sab->ska", k, positions)  # [S, K, A]
    cos, sin = torch.cos(phase), torch.sin(phase)
    structure_cos = torch.einsum("ska,sac->skc", cos, q) * kernel[:, :, None]
    structure_sin = torch.einsum("ska,sac->skc", sin, q) * kernel[:, :, None]
    potential = torch.einsum("ska,skc->sac", cos, structure_cos) + torch.einsum(
        "ska,skc->sac", sin, structure_sin
    )
    return potential / volume[:, None, None] + corrections(q, volume, sigma)


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
    spectrum (see :func:`p3m`), so it filters each bin of the other half (z index
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


def p3m(q, positions, cell, sizes, mesh, volume, sigma: float, order: int):
    """Reciprocal-space potential ``[A, C]`` (before the 1/2) of one structure by P3M.

    ``q [A, C]``, ``positions [A, 3]``, ``cell [3, 3]``, ``sizes [3]`` (integer mesh
    sizes), ``mesh`` a tensor of the mesh's shape.
    """
    nx, ny, nz = mesh.shape
    channels = q.shape[1]
    dtype, device = positions.dtype, positions.device
    # charge assignment: the ``order`` nearest mesh points along each axis
    scaled = sizes.to(dtype) * (positions @ inverse_cell(cell))  # [A, 3] in mesh units
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
    reciprocal = 2 * math.pi * inverse_cell(cell64).T  # rows b_a
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
    kernel = (influence * coulomb_kernel(k_sq, sigma)).to(dtype)
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
    return at_atoms / volume + corrections(q[None], volume[None], sigma)[0]
