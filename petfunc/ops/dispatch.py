"""When PET's ``autograd.Function``\\ s with hand-written derivatives are used.

:func:`petfunc.ops.permute.permute_rows` and :func:`petfunc.ops.lookup.lookup_rows` are
gathers whose adjoints are a gather and a matrix product instead of autograd's
scatter-add (``index_put_`` with accumulation). They give the same numbers as
plain indexing (up to the order of summation of the lookups' adjoint).

* While ``make_fx`` traces (``petfunc.compile``, ``petfunc export``) they change the
  compiled code: no atomic scatter-adds.
* Eagerly on the CPU, with plain autograd (``autodiff="autograd"``: the eager ASE
  calculator, relaxations and MD, and ``petfunc train`` without ``--compile``), they
  make a step faster: PyTorch's CPU scatter-add with accumulation adds with atomics
  (``benchmarks/compare_step.py --eager``, see docs/performance.md). Under
  ``torch.use_deterministic_algorithms`` (what ``petfunc train`` sets on the CPU
  by default) the scatter-add is serial and as fast: no change there. On GPUs,
  where the scatter-add is fast and eager steps are bound by Python, plain
  indexing is kept (not measured).
* Eagerly inside ``torch.func`` transforms (``autodiff="func"``, vmapped
  ensembles) each ``autograd.Function`` call costs Python time, so plain indexing
  is kept there.
* Under ``torch.compile``'s Dynamo (a user compiling an energy function directly)
  plain indexing is kept as well: Dynamo traces it as it always did.
* Small eager calls keep plain indexing too: a ``Function`` costs tens of
  microseconds of Python for its forward and backward, about what the scatter-add of
  :data:`EAGER_MIN_ELEMENTS` elements costs (a permutation of 32768 float32
  elements is about as fast either way). With every call through the ``Function``,
  a small molecule's forces in the eager ASE calculator took a fifth longer; with
  this threshold, about as long as plain indexing.
"""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import get_proxy_mode


#: the smallest output (elements) for which an eager call takes the ``Function``
EAGER_MIN_ELEMENTS = 32768


def use_custom_derivatives(numel: int, device: torch.device) -> bool:
    """Whether a call made now, whose output has ``numel`` elements on ``device``,
    should go through the ``autograd.Function``."""
    if get_proxy_mode() is not None:
        return True
    if numel < EAGER_MIN_ELEMENTS or device.type != "cpu" or torch.compiler.is_compiling():
        return False
    return torch._C._functorch.peek_interpreter_stack() is None
