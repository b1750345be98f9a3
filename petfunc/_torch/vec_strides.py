"""Cheaper stride analysis for inductor's vectorized C++ kernels.

For every load and store of a vectorized CPU loop, inductor asks how the index
moves when the vectorized loop variable ``x`` steps by one (0: broadcast, 1:
contiguous, else strided or gathered). It answers with ``sympy.simplify`` of the
index and of the difference ``index(x + 1) - index(x)``
(``simplify_index_in_vec_range`` and ``stride_at`` of ``torch._inductor.sizevars``;
``torch._inductor.codegen.cpp`` in torch 2.11).
``simplify`` tries many rewrites, and with symbolic sizes PET's training step has
well over a thousand distinct indices, and in a cold compile of the benchmarks'
carbon training step most of its time goes to indices that are plain polynomials in
the loop variables and size symbols
(``384*d0*s53 + 384*d0 + 16*d1*s53 + 16*d1 + d2*s53 + d2 + d3``), which it returns
unchanged.

For such a polynomial (sums and products of integer symbols, rational numbers and
non-negative integer powers, no ``FloorDiv``, ``ModularIndexing`` or other function)
the expanded difference is the canonical form of the stride: it is a number exactly
when ``simplify``'s is the same number, so every decision inductor takes on it
(broadcast, contiguous, constant or symbolic stride) is the same, and a symbolic
stride differs at most in how it is written (``s53 + 1`` either way in PET's
graphs). Any other index goes to inductor's own functions unchanged.

With it, almost none of those calls are left, and the generated code is byte for
byte the same (compared for the qm9 and carbon training steps): a shorter cold
compile (``benchmarks/cold_compile.py --variants grouped simplify``, see
docs/performance.md). ``PETFUNC_FAST_STRIDES=0`` (or ``PETFUNC_PATCHES_OFF=fast_strides``)
turns this off.
"""

from __future__ import annotations

import functools
import importlib
import sys

from petfunc._torch import versions
from petfunc._torch.patch import SPEED, replacing


def is_polynomial(expr) -> bool:
    """Whether ``expr`` is built of symbols and rational numbers by ``+``, ``*`` and
    non-negative integer powers only."""
    import sympy  # slow to import: loaded where inductor compiles, which imports it anyway

    stack = [expr]
    while stack:
        node = stack.pop()
        if isinstance(node, (sympy.Symbol, sympy.Rational)):
            continue
        if isinstance(node, (sympy.Add, sympy.Mul)):
            stack.extend(node.args)
        elif isinstance(node, sympy.Pow):
            base, exponent = node.args
            if not (isinstance(exponent, sympy.Integer) and exponent >= 0):
                return False
            stack.append(base)
        else:
            return False
    return True


def analysis_module():
    """The module whose ``stride_at_vec_range`` looks up ``stride_at`` and
    ``simplify_index_in_vec_range`` (``torch._inductor.sizevars`` in torch 2.13,
    ``torch._inductor.codegen.cpp`` in 2.11), or None."""
    for name in ("torch._inductor.sizevars", "torch._inductor.codegen.cpp"):
        try:
            module = importlib.import_module(name)
        except ImportError:  # pragma: no cover - inductor unavailable
            continue
        if all(
            hasattr(module, f) for f in ("stride_at_vec_range", "stride_at", "simplify_index_in_vec_range")
        ):
            return module
    return None


def _targets():
    # where no module has the analysis, the newest torch's place: the install then fails
    module = analysis_module() or importlib.import_module("torch._inductor.sizevars")
    return [(module, "stride_at"), (module, "simplify_index_in_vec_range")]


def _replacements(original_stride, original_range):
    import sympy  # slow to import: loaded where inductor compiles, which imports it anyway

    @functools.lru_cache
    def stride_at(index, var):
        if is_polynomial(index):
            return sympy.expand(index.xreplace({var: var + 1}) - index)
        return original_stride(index, var)

    @functools.lru_cache
    def simplify_index_in_vec_range(index, var, vec_length):
        # the simplified index only feeds stride_at (the docstring above), which
        # needs no rewriting of a polynomial
        if is_polynomial(index):
            return index
        return original_range(index, var, vec_length)

    return [stride_at, simplify_index_in_vec_range]


# WORKAROUND(torch<2.15): inductor's vectorization analysis runs sympy.simplify on
# every index of a vectorized C++ loop, which dominates its time on symbolic sizes.
# Remove when inductor skips simplify for polynomial indices.
FAST_STRIDES = replacing(
    "fast_strides",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's stride analysis of vectorized C++ loads by expansion, not sympy.simplify",
    module=sys.modules[__name__],
    targets=_targets,
    replacements=_replacements,
)


def fast_strides():
    """A ``with`` block in which inductor analyses polynomial indices by expansion
    instead of ``sympy.simplify`` (the module docstring): the patch
    :data:`FAST_STRIDES` held; a no-op where it is off."""
    return FAST_STRIDES.scope()
