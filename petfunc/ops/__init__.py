"""Kernels with hand-written adjoints: gathers whose derivatives are gathers or
matrix products (no atomic scatter-adds), batched products whose derivatives keep
their operands' layouts, PET's grid attention, and its fused CPU kernels
(:mod:`petfunc.ops.fused_attention`)."""

from petfunc.ops.attention import grid_attention as grid_attention
from petfunc.ops.bmm import bmm_nn as bmm_nn
from petfunc.ops.bmm import bmm_nt as bmm_nt
from petfunc.ops.bmm import bmm_tn as bmm_tn
from petfunc.ops.dispatch import use_custom_derivatives as use_custom_derivatives
from petfunc.ops.lookup import lookup_rows as lookup_rows
from petfunc.ops.permute import permute_rows as permute_rows
