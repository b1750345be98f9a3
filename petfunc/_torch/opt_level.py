"""The ``g++`` optimisation level of inductor's C++ kernels.

Inductor vectorizes its kernels itself (``at::vec``, with
``-fno-tree-loop-vectorize``); what ``-O3`` adds over ``-O2`` (loop unswitching,
peeling, splitting and distribution, predictive commoning, larger inlining budgets)
costs about a quarter of each ``g++`` run. ``PETFUNC_KERNEL_OPT=O2``
(:func:`petfunc._torch.settings.kernel_opt_level`) trades that for speed: a cold
compile a little shorter for a step a little slower (``benchmarks/cold_compile.py
--variants grouped o2``, see docs/performance.md). After about a thousand steps
``-O3`` is ahead, hence inductor's default stays; short jobs (tests, a quick
fine-tune) may prefer ``O2``. Flags are part of the key of inductor's library cache,
so kernels built at another level are never mixed up with these.
"""

from __future__ import annotations

import functools
import sys

from petfunc._torch import settings, versions
from petfunc._torch.patch import SPEED, replacing


def _targets():
    from torch._inductor import cpp_builder

    return [(cpp_builder, "_get_optimization_cflags")]


def _replacements(original):
    level = settings.kernel_opt_level()

    @functools.wraps(original)
    def optimization_cflags(*args, **kwargs):
        cflags, ldflags = original(*args, **kwargs)
        # only the kernels' level: the AOT wrapper's own (min_optimize) is left as is
        return [level if flag == settings.INDUCTOR_OPT_LEVEL else flag for flag in cflags], ldflags

    return [optimization_cflags]


# WORKAROUND(torch<2.15): inductor has no setting for the optimisation level of its
# C++ kernels (it builds them at -O3). Remove when it has one. A no-op unless
# PETFUNC_KERNEL_OPT names another level.
KERNEL_OPT_LEVEL = replacing(
    "kernel_opt_level",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's C++ kernels built at PETFUNC_KERNEL_OPT instead of -O3",
    module=sys.modules[__name__],
    targets=_targets,
    replacements=_replacements,
    wanted=lambda: settings.kernel_opt_level() != settings.INDUCTOR_OPT_LEVEL,
)
