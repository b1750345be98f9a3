"""Inductor's choice of float32 summation scheme on the CPU, made without a guard.

For a float32 sum over more than 4096 elements inductor's C++ kernels use a
cascade-sum helper (better round-off). With a symbolic length it decides on the
example's length and guards that decision (torch 2.13: ``guard_or_false(n > 4096)``;
2.11: ``check_leq``/``check_lt``), so a graph traced on a small batch compiles again
for a batch of more than 4096 atoms or edges, and one traced on a large batch for a
small one. Both kernels are right for every length; only the rounding of long sums
differs. :data:`UNGUARDED_SUM_HELPER` makes the choice follow the example's length
and records no guard. (A graph loaded from inductor's cache never re-added that
guard, so warm starts already behaved so.)
"""

from __future__ import annotations

import functools
import operator
import sys

import torch

from petfunc._torch import versions
from petfunc._torch.patch import SPEED, replacing


def example_size(sizevars, expr) -> int | None:
    """The value of a symbolic size for the example inputs, without a guard; None
    when it has none. (torch 2.13 renamed inductor's ``size_hint`` to
    ``optimization_hint``: a lookup of the old name alone fails there, and took the
    cascade helper for every float32 sum, softmax rows and layer norms included,
    which made those kernels several times slower.)"""
    for name in ("optimization_hint", "size_hint"):
        method = getattr(sizevars, name, None)
        if method is not None:
            try:
                return int(method(expr))
            except Exception:  # noqa: BLE001 - no hint: the caller's safe choice
                return None
    return None


def _targets():
    from torch._inductor.codegen import cpp

    return [(cpp.CppKernel, "need_use_acc_helper")]


def _replacements(original):
    from torch._inductor.virtualized import V

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type != "sum" or dtype != torch.float or self.call_ranges is None:
            return original(self, reduction_type, dtype, use_scalar)
        length = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth :], 1)
        hint = example_size(V.graph.sizevars, length)
        # no example value: the helper, the safe choice, as inductor makes it
        return hint is None or hint > 4096

    return [need_use_acc_helper]


# WORKAROUND(torch<2.15): inductor guards its choice of float32 summation helper on
# the example's length, so a graph recompiles when a batch crosses 4096 summed
# elements. Remove when inductor makes the choice without a guard. Off: a graph
# compiles again for batches on the other side of 4096 (num_graphs counts them).
UNGUARDED_SUM_HELPER = replacing(
    "unguarded_sum_helper",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's float32 cascade-sum choice made on the example's length without a guard",
    module=sys.modules[__name__],
    targets=_targets,
    replacements=_replacements,
)
