"""Every patch of torch's internals that petfunc makes, in one list, and which of
them :func:`petfunc.compile` holds where."""

from __future__ import annotations

from petfunc._torch.addmm import ADDMM_MERGE_HOLD, ADDMM_SPLIT
from petfunc._torch.cpu_kernels import KERNEL_GROUPS
from petfunc._torch.fft_meta import FFT_META
from petfunc._torch.inductor_config import TRITON_TILING
from petfunc._torch.patch import Patch
from petfunc._torch.sum_helper import UNGUARDED_SUM_HELPER
from petfunc._torch.vec_strides import FAST_STRIDES
from petfunc._torch.vmap_rules import LAYER_NORM_DECOMPOSITION, VMAP_RULES


PATCHES: tuple[Patch, ...] = (
    VMAP_RULES,
    LAYER_NORM_DECOMPOSITION,
    FFT_META,
    TRITON_TILING,
    KERNEL_GROUPS,
    FAST_STRIDES,
    UNGUARDED_SUM_HELPER,
    ADDMM_SPLIT,
    ADDMM_MERGE_HOLD,
)


def patches() -> tuple[Patch, ...]:
    """Every patch of torch's internals that petfunc makes (:class:`Patch` objects:
    their name, purpose, version gate, state, and install/uninstall)."""
    return PATCHES


def trace_patches() -> list[Patch]:
    """The patches :func:`petfunc.compile` holds while ``make_fx`` traces."""
    return [FFT_META, VMAP_RULES]


def backend_patches(on_cpu: bool) -> list[Patch]:
    """The patches :func:`petfunc.compile` holds while a backend compiles a graph:
    every inductor patch, with the Triton tiling analysis off for GPU graphs."""
    device = [] if on_cpu else [TRITON_TILING]
    return [
        ADDMM_SPLIT,
        *device,
        KERNEL_GROUPS,
        UNGUARDED_SUM_HELPER,
        FFT_META,
        FAST_STRIDES,
        ADDMM_MERGE_HOLD,
    ]
