"""Smooth switching functions f(d) that take an edge from weight 1 to weight 0.

With ``s = (d - (r_cut - width)) / width``, f = 1 for s <= 0 and f = 0 for s >= 1.
Both follow metatrain exactly, including the clamps (which make f exactly 1 inside
``r_cut - width`` and exactly 0 beyond ``r_cut``, with zero gradient there).
"""

from __future__ import annotations

import math

import torch


def bump(distances: torch.Tensor, r_cut, width: float) -> torch.Tensor:
    """C-infinity bump: f = (1 + tanh(cot(pi s))) / 2, s clamped to [1e-6, 1 - 1e-6]."""
    s = ((distances - (r_cut - width)) / width).clamp(1e-6, 1.0 - 1e-6)
    return 0.5 * (1.0 + torch.tanh(1.0 / torch.tan(math.pi * s)))


def cosine(distances: torch.Tensor, r_cut, width: float) -> torch.Tensor:
    """Cosine switch: f = (1 + cos(pi s)) / 2, s clamped to [0, 1]."""
    s = ((distances - (r_cut - width)) / width).clamp(0.0, 1.0)
    return 0.5 * (1.0 + torch.cos(math.pi * s))


def switching_function(name: str):
    """The function called ``name`` in :class:`~petfunc.PETConfig` (``Bump``/``Cosine``)."""
    return {"Bump": bump, "Cosine": cosine}[name]
