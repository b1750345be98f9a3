"""Reproducible runs: deterministic scatter-adds.

Summing many values into fewer slots (the adjoint of gathering atoms onto edges,
the per-structure energy sums, their derivatives) runs in parallel on CPU with
atomic float adds, both in torch's eager ``index_put_(accumulate=True)`` on float32
and in inductor's generated scatter kernels. Their order changes from run to run,
so two trainings with the same seed drift apart from the first step by float32
round-off, and the chaos of training grows that into visibly different models.
With deterministic algorithms torch runs those sums in a fixed order and inductor
lowers scatter-adds to torch's deterministic kernels. On a CPU that costs the
compiled training step nothing measurable and makes the eager one a little faster
(``benchmarks/compare_step.py --deterministic [--eager]``; docs/performance.md has
the figures). Its cost on CUDA is not measured.
"""

from __future__ import annotations

import contextlib
import os

import torch


@contextlib.contextmanager
def deterministic_algorithms(enabled: bool = True):
    """Run the body with ``torch.use_deterministic_algorithms(enabled)``.

    An operation without a deterministic implementation warns instead of failing
    (``warn_only``). Compile inside the context: inductor chooses its scatter
    kernels when it lowers a graph. On CUDA, cuBLAS also needs a fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``), which it reads when its first handle is made; it
    is set here for the process unless the environment already sets it. The previous
    deterministic setting is restored on exit.
    """
    previous = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
    )
    if enabled:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(enabled, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(previous[0], warn_only=previous[1])
