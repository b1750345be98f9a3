"""The torch version petfunc runs on, and which torch needs which patch.

Every version condition of petfunc's patches of torch internals
(:mod:`petfunc._torch`) is a named gate here: a patch whose gate is false is never
installed. The gates name the torch versions on which the reason for a patch is
known to hold; all of them end at the newest torch ``pyproject.toml`` admits, so
raising that pin means checking each reason again (the tests of
``tests/compile/test_patches.py`` tell which still hold).
"""

from __future__ import annotations

import torch


def parse(version: str) -> tuple[int, int]:
    """``(major, minor)`` of a torch version string such as ``"2.13.0+cpu"``."""
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


#: ``(major, minor)`` of the running torch
TORCH = parse(torch.__version__)

#: the newest torch petfunc is checked on (``pyproject.toml`` pins ``torch<2.15``)
CHECKED_UP_TO = (2, 14)

#: torch's C++ vmap batching rules of ``cat``, ``scatter_add``, ``gather``,
#: ``slice_backward`` and the layer-norm pair (on 2.11-2.12 also ``mm`` and ``bmm``)
#: read tensor sizes as integers, which fixes symbolic sizes in a trace
VMAP_RULES_READ_INTEGER_SIZES = TORCH <= CHECKED_UP_TO

#: the third derivative of ``native_layer_norm`` is wrong (its mean and rstd outputs
#: are not differentiable) and its forward-mode derivative does not trace on fake tensors
LAYER_NORM_HIGHER_DERIVATIVES_WRONG = TORCH <= CHECKED_UP_TO

#: the meta functions of ``_fft_r2c``/``_fft_c2c``/``_fft_c2r`` read sizes as integers
#: (r2c on the CPU) or fail on symbolic sizes (c2c, c2r)
FFT_META_NOT_SYMBOLIC = TORCH <= CHECKED_UP_TO

#: inductor's C++ code generation and scheduling, the targets of petfunc's speed
#: patches (kernel groups, stride analysis, summation choice, addmm, fusion attempts),
#: measured on torch 2.11 and 2.13
INDUCTOR_SPEED_PATCHES = TORCH <= CHECKED_UP_TO

#: inductor's Triton tiling analysis fails an assertion on symbolic sizes (torch 2.11, H200)
TRITON_TILING_ANALYSIS_FAILS = TORCH <= CHECKED_UP_TO
