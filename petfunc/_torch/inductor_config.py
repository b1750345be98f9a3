"""Inductor settings petfunc chooses for its graphs: fewer fusion attempts on the
CPU, no Triton tiling analysis on GPUs. Each holds while petfunc compiles; an
option of the caller's own (``petfunc.compile(..., options=...)``) takes precedence.
"""

from __future__ import annotations

import sys

from petfunc._torch import settings, versions
from petfunc._torch.patch import CORRECTNESS, SPEED, replacing


def _config(name):
    def targets():
        import torch._inductor.config

        owner = torch._inductor.config
        for part in name.split(".")[:-1]:
            owner = getattr(owner, part)
        return [(owner, name.split(".")[-1])]

    return targets


# WORKAROUND(torch<2.15): inductor's scheduler tries each node against the next 64
# readers and writers of every buffer it uses. In a training step compiled with a
# packed state (petfunc.init_state) every node that reads a parameter reads the one
# parameter buffer: thousands of candidate pairs, nearly all of them nodes on
# unrelated slices. With 16 the generated code of the benchmarks' training steps is
# the same, byte for byte, and their fusion takes much less time
# (benchmarks/cold_compile.py --variants grouped fusion64). Applied to CPU graphs
# only (the only device it was measured on). Remove when inductor's fusion skips
# pairs on disjoint slices of one buffer.
FUSION_PAIR_ATTEMPTS = replacing(
    "fusion_pair_attempts",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's max_fusion_buffer_group_pairwise_attempts set to PETFUNC_FUSION_PAIR_ATTEMPTS "
    "(16) on the CPU",
    module=sys.modules[__name__],
    targets=_config("max_fusion_buffer_group_pairwise_attempts"),
    replacements=lambda original: [settings.fusion_pair_attempts()],
)

# WORKAROUND(torch<2.15): inductor's memory-coalescing analysis of Triton tilings
# (meant for static shapes, says its config) failed an assertion on the symbolic sizes
# of PET's carbon training step (torch 2.11, H200: get_pw_red_splits in tiling_utils).
# Remove when that analysis handles symbolic sizes. Off: such a graph fails to compile
# with inductor's assertion. GPU graphs only.
TRITON_TILING = replacing(
    "triton_tiling",
    purpose=CORRECTNESS,
    needed=versions.TRITON_TILING_ANALYSIS_FAILS,
    summary="inductor's triton.coalesce_tiling_analysis off for GPU graphs",
    module=sys.modules[__name__],
    targets=_config("triton.coalesce_tiling_analysis"),
    replacements=lambda original: [False],
)
