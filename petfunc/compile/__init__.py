"""petfunc.compile."""

from petfunc.compile.compiled import (
    Compiled,
    compile,
    early_addmm_split,
    fusion_pair_attempts,
    hold_cpu_addmm_merge,
    no_duck_shape,
    trace_cache_dir,
    unguarded_sum_helper,
)
