"""petfunc.compile."""

from petfunc._torch.fft_meta import fft_c2c as fft_c2c
from petfunc._torch.fft_meta import fft_c2r as fft_c2r
from petfunc._torch.fft_meta import fft_r2c as fft_r2c
from petfunc._torch.vmap_rules import LAYER_NORM_DECOMPOSITION as LAYER_NORM_DECOMPOSITION
from petfunc._torch.vmap_rules import VMAP_RULES as VMAP_RULES
from petfunc._torch.vmap_rules import symbolic_vmap_rules as symbolic_vmap_rules
from petfunc.compile.compiled import Compiled as Compiled
from petfunc.compile.compiled import compile as compile
from petfunc.compile.compiled import early_addmm_split as early_addmm_split
from petfunc.compile.compiled import fusion_pair_attempts as fusion_pair_attempts
from petfunc.compile.compiled import hold_cpu_addmm_merge as hold_cpu_addmm_merge
from petfunc.compile.compiled import no_duck_shape as no_duck_shape
from petfunc.compile.compiled import trace_cache_dir as trace_cache_dir
from petfunc.compile.compiled import unguarded_sum_helper as unguarded_sum_helper
