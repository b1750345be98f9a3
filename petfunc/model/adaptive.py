"""Adaptive per-atom cutoff radii r_i (metatrain's ``num_neighbors_adaptive``).

Each atom gets the radius at which its smoothed neighbour count
``n_i(r) = sum_{e: c_e = i} bump(d_e; r, w_a) + nu (r / r_max)^3`` equals ``nu``.
Both methods are differentiable functions of the edge distances, so the forces
contain the dr_i/dx term (the one metatrain's compiled-PET pull request lost).

* ``solver``: 10 Newton-bisection steps on detached distances, then
  implicit-function steps on the live distances (gradient -dn_i/dd / n_i', and
  the implicit function's second derivative, for Hessians).
* ``grid``: a Gaussian-weighted average of probe radii, fully differentiable.

Everything has a fixed trip count and fixed shapes, so it traces with ``make_fx``.
"""

from __future__ import annotations

import math

import torch

from petfunc.model.cutoff import bump


def _segment_sum(values: torch.Tensor, index: torch.Tensor, n: int) -> torch.Tensor:
    out = torch.zeros(n, dtype=values.dtype, device=values.device)
    return out.scatter_add(0, index, values)


# The solver's ten steps are not converged where n_i(r) has flat shoulders, so their
# result depends on round-off: every expression below is evaluated in metatrain's
# order (r * (1 / r_max), not r / r_max) to follow the same path bit for bit.


def _count(r, distances, centers, n_atoms, width, r_max, nu):
    per_edge = bump(distances, r[centers], width)
    x = r * (1.0 / r_max)
    return _segment_sum(per_edge, centers, n_atoms) + nu * x.pow(3)


def _count_and_slope(r, distances, centers, n_atoms, width, r_max, nu):
    s = (distances - (r[centers] - width)) / width
    active = (s > 0.0) & (s < 1.0)
    arg = math.pi * s.clamp(1e-6, 1.0 - 1e-6)
    sin = torch.sin(arg)
    t = torch.tanh(torch.cos(arg) / sin)
    f = torch.where(active, 0.5 * (1.0 + t), (s <= 0.0).to(s.dtype))
    df = (0.5 * math.pi / width) * (1.0 - t * t) / (sin * sin) * active.to(s.dtype)
    inv_r_max = 1.0 / r_max
    x = r * inv_r_max
    n = _segment_sum(f, centers, n_atoms) + nu * x.pow(3)
    dn = _segment_sum(df, centers, n_atoms) + 3.0 * nu * x.pow(2) * inv_r_max
    return n, dn


def _curvature(r, distances, centers, n_atoms, width, r_max, nu):
    """n_rr: the second derivative of the count in r, ``[n_atoms]``."""
    s = (distances - (r[centers] - width)) / width
    active = (s > 0.0) & (s < 1.0)
    arg = math.pi * s.clamp(1e-6, 1.0 - 1e-6)
    sin, cos = torch.sin(arg), torch.cos(arg)
    t = torch.tanh(cos / sin)
    # d/dr of the slope's (pi / 2 w) (1 - t^2) / sin^2, with d arg / dr = -pi / w
    ddf = (
        (-((math.pi / width) ** 2)) * (1.0 - t * t) * (t / sin - cos) / (sin * sin * sin) * active.to(s.dtype)
    )
    return _segment_sum(ddf, centers, n_atoms) + 6.0 * nu * r / r_max**3


def cutoffs_solver(centers, distances, n_atoms: int, nu: float, r_max: float, width: float):
    """Per-atom radii ``[n_atoms]`` by Newton-bisection plus an implicit-function step.

    Args:
        centers: ``[n_edges]`` centre atom of each edge of the full list.
        distances: ``[n_edges]`` |r_e| + 1e-15 (differentiable).
        n_atoms, nu, r_max, width: number of atoms, target count, largest radius and
            counting taper width ``cutoff_width_adaptive``.
    """
    d = distances.detach()
    lo = torch.zeros(n_atoms, dtype=d.dtype, device=d.device)
    hi = torch.full((n_atoms,), r_max, dtype=d.dtype, device=d.device)
    r = 0.5 * hi
    for _ in range(10):  # metatrain's fixed iteration count
        n, dn = _count_and_slope(r, d, centers, n_atoms, width, r_max, nu)
        g = n - nu
        below = g <= 0
        lo = torch.where(below, r, lo)
        hi = torch.where(below, hi, r)
        r_newton = r - g / dn.clamp_min(1e-6)
        inside = (r_newton >= lo) & (r_newton <= hi)
        r = torch.where(inside, r_newton, 0.5 * (lo + hi))
    r = r.detach()
    # the slope n_r(r, d), live in the distances (for the second derivative below)
    _, slope_live = _count_and_slope(r, distances, centers, n_atoms, width, r_max, nu)
    slope = slope_live.detach().clamp_min(1e-6)
    residual = _count(r, distances, centers, n_atoms, width, r_max, nu) - nu
    step = r - residual / slope  # metatrain's radii and first derivative, -n_d / n_r
    # With r and the slope constant, the step's second derivative is -n_dd / n_r,
    # which lacks the terms of the implicit function r(d) (n(r(d), d) = nu):
    #   r'' = -n_dd / n_r + 2 n_d n_rd / n_r^2 - n_d^2 n_rr / n_r^3,
    # so Hessians of the energy were ~10 % off. They are added as terms whose value
    # and first derivative are exactly zero (products of two quantities that are
    # zero in value): u = step - step.detach() has u' = r' = -n_d / n_r, and
    # w = -(n_r - n_r.detach()) / n_r has w' = -n_rd / n_r. (w u)'' and
    # -(n_rr / 2 n_r) (u^2)'' are the two missing terms; the radii and the forces
    # stay metatrain's bit for bit.
    u = step - step.detach()
    w = -(slope_live - slope_live.detach()) / slope
    curvature = _curvature(r, d, centers, n_atoms, width, r_max, nu)
    correction = w * u - (0.5 * curvature / slope) * (u * u)
    return (step + correction).clamp(r_max / 16.0, r_max)


def _unit_gradient(x: torch.Tensor) -> torch.Tensor:
    """``torch.gradient(x, dim=-1)`` with unit spacing, written with slices."""
    first = x[..., 1:2] - x[..., 0:1]
    last = x[..., -1:] - x[..., -2:-1]
    inner = 0.5 * (x[..., 2:] - x[..., :-2])
    return torch.cat([first, inner, last], dim=-1)


def cutoffs_grid(centers, distances, n_atoms: int, nu: float, r_max: float, width: float):
    """Per-atom radii ``[n_atoms]`` by metatrain's legacy probe grid.

    The weights use a max over the *whole batch* (as metatrain does), so atoms of one
    batch are coupled at round-off level.
    """
    probes = torch.arange(0.5, r_max, width / 4.0, dtype=distances.dtype, device=distances.device)
    weights = bump(distances[None, :], probes[:, None], width)  # [P, E]
    counts = torch.zeros(
        (probes.shape[0], n_atoms), dtype=distances.dtype, device=distances.device
    ).scatter_add(1, centers[None, :].expand(probes.shape[0], -1), weights)
    counts = counts.T  # [n_atoms, P]
    x = torch.linspace(0.0, 1.0, probes.shape[0], dtype=distances.dtype, device=distances.device)
    diff = counts - nu + nu * x**3
    if diff.shape[-1] == 1:
        omega = diff.abs() * 0.5 + 1e-12
    else:
        omega = _unit_gradient(diff).abs().clamp_min(1e-12)
    logw = -0.5 * (diff / omega) ** 2
    # the shift cancels in the normalisation: detached, it couples no atoms' gradients
    w = torch.exp(logw - logw.max().detach()) if logw.numel() else logw
    w = w / w.sum(dim=1, keepdim=True)
    return w @ probes


def atomic_cutoffs(config, centers, distances, n_atoms: int):
    """Adaptive radii for ``config`` (its method, target count, cutoff and width)."""
    fn = cutoffs_solver if config.adaptive_cutoff_method == "solver" else cutoffs_grid
    return fn(
        centers,
        distances,
        n_atoms,
        float(config.num_neighbors_adaptive),
        float(config.cutoff),
        float(config.cutoff_width_adaptive),
    )
