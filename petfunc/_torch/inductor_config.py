"""Inductor settings petfunc chooses for its graphs: no Triton tiling analysis on
GPUs. It holds while petfunc compiles; an option of the caller's own
(``petfunc.compile(..., options=...)``) takes precedence.
"""

from __future__ import annotations

import sys

from petfunc._torch import versions
from petfunc._torch.patch import CORRECTNESS, replacing


def _config(name):
    def targets():
        import torch._inductor.config

        owner = torch._inductor.config
        for part in name.split(".")[:-1]:
            owner = getattr(owner, part)
        return [(owner, name.split(".")[-1])]

    return targets


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
