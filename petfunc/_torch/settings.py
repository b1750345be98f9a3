"""Every ``PETFUNC_*`` environment setting that :mod:`petfunc.compile` and
:mod:`petfunc._torch` read, read here and nowhere else.

Each is read when it is used (not at import), so a process may change it between
two compilations, as the benchmarks and tests do.

Patches of torch internals (``from petfunc.compile import patches``):

* ``PETFUNC_STOCK_TORCH=1``: no patch at all; petfunc runs torch as shipped.
* ``PETFUNC_PATCHES_OFF=name,name``: these patches off (names as in
  ``patches()``), for side-by-side benchmarks.
* switches of single patches: ``PETFUNC_GROUP_KERNELS=0`` (``kernel_groups``),
  ``PETFUNC_FAST_STRIDES=0`` (``fast_strides``), ``PETFUNC_EARLY_ADDMM_SPLIT=0``
  (``addmm_merge_hold``).

The compile path: ``PETFUNC_DIRECT_INDUCTOR=0`` (inductor through AOTAutograd),
``PETFUNC_EARLY_ISA_PROBE=0``, ``PETFUNC_FUSED_ATTENTION=1``,
``PETFUNC_TRACE_CACHE=0`` and ``PETFUNC_TRACE_CACHE_DIR``.
"""

from __future__ import annotations

import os


#: the switches of single patches (``=0`` turns the patch off, as
#: ``PETFUNC_PATCHES_OFF`` does)
PATCH_SWITCHES = {
    "kernel_groups": "PETFUNC_GROUP_KERNELS",
    "fast_strides": "PETFUNC_FAST_STRIDES",
    "addmm_merge_hold": "PETFUNC_EARLY_ADDMM_SPLIT",
}


def stock_torch() -> bool:
    """``PETFUNC_STOCK_TORCH=1``: every patch of torch internals off."""
    return os.environ.get("PETFUNC_STOCK_TORCH", "0") == "1"


def patches_off() -> set[str]:
    """The names ``PETFUNC_PATCHES_OFF`` lists (comma-separated)."""
    return {name.strip() for name in os.environ.get("PETFUNC_PATCHES_OFF", "").split(",") if name.strip()}


def patch_on(name: str) -> bool:
    """Whether the settings leave the patch ``name`` on (its version gate aside)."""
    if stock_torch() or name in patches_off():
        return False
    switch = PATCH_SWITCHES.get(name)
    return switch is None or os.environ.get(switch, "1") != "0"


def early_isa_probe() -> bool:
    """Whether inductor's probe of the CPU's vector instruction sets starts while
    ``make_fx`` traces (``PETFUNC_EARLY_ISA_PROBE=0``: when inductor needs it)."""
    return os.environ.get("PETFUNC_EARLY_ISA_PROBE", "1") != "0"


def direct_inductor() -> bool:
    """Whether inductor compiles the traced graph without AOTAutograd by default
    (``PETFUNC_DIRECT_INDUCTOR=0``: through AOTAutograd, as torch.compile does)."""
    return os.environ.get("PETFUNC_DIRECT_INDUCTOR", "1") != "0"


def fused_attention() -> bool:
    """Whether :func:`petfunc.compile` traces PET's attention as the fused CPU kernels
    by default (``PETFUNC_FUSED_ATTENTION=1``)."""
    return os.environ.get("PETFUNC_FUSED_ATTENTION", "0") == "1"


def trace_cache() -> bool:
    """Whether traced graphs are cached (``PETFUNC_TRACE_CACHE=0``: never)."""
    return os.environ.get("PETFUNC_TRACE_CACHE", "1") != "0"


def trace_cache_folder() -> str | None:
    """``PETFUNC_TRACE_CACHE_DIR``, the folder of cached traces, if set."""
    return os.environ.get("PETFUNC_TRACE_CACHE_DIR") or None
