"""Arithmetic on lists of tensors (an optimizer's leaves), one operation per list.

``torch._foreach_*`` operations are one node each in a traced graph, whatever the
number of tensors. A loop over PET's ~115 parameter tensors puts ~115 nodes per
operation into the graph instead, and then the clipping and the Adam update were
half of the training step's graph: tracing, AOTAutograd and inductor's code
generation spent about 40 % of the compile time on them.

The results are those of the per-tensor loop, bit for bit (the foreach operations
apply the same kernels to each tensor). ``vmap`` has no batching rules for foreach
operations, so under a ``torch.func`` transform (an ensemble's vmapped training step)
the loop runs instead. :func:`by_dtype` splits lists of mixed dtypes.
"""

from __future__ import annotations

from typing import List, Sequence, Union

import torch

Tensors = Sequence[torch.Tensor]
Operand = Union[Tensors, torch.Tensor, float]


def _fused(tensors: Tensors) -> bool:
    is_wrapped = torch._C._functorch.is_functorch_wrapped_tensor
    return len(tensors) > 0 and not any(is_wrapped(t) for t in tensors)


def _pairs(other: Operand, n: int):
    return other if isinstance(other, (list, tuple)) else [other] * n


def mul(a: Tensors, b: Operand) -> List[torch.Tensor]:
    """``[x * y]``; ``b`` a list, a 0-d tensor or a float."""
    if _fused(a) and (not isinstance(b, (list, tuple)) or _fused(b)):
        return list(torch._foreach_mul(a, b))
    return [x * y for x, y in zip(a, _pairs(b, len(a)))]


def div(a: Tensors, b: Operand) -> List[torch.Tensor]:
    """``[x / y]``; ``b`` a list, a 0-d tensor or a float."""
    if _fused(a) and (not isinstance(b, (list, tuple)) or _fused(b)):
        return list(torch._foreach_div(a, b))
    return [x / y for x, y in zip(a, _pairs(b, len(a)))]


def add(a: Tensors, b: Union[Tensors, float]) -> List[torch.Tensor]:
    """``[x + y]``; ``b`` a list or a float."""
    if _fused(a) and (not isinstance(b, (list, tuple)) or _fused(b)):
        return list(torch._foreach_add(a, b))
    return [x + y for x, y in zip(a, _pairs(b, len(a)))]


def sub(a: Tensors, b: Tensors) -> List[torch.Tensor]:
    """``[x - y]``."""
    if _fused(a) and _fused(b):
        return list(torch._foreach_sub(a, b))
    return [x - y for x, y in zip(a, b)]


def lerp(a: Tensors, b: Tensors, weight: float) -> List[torch.Tensor]:
    """``[torch.lerp(x, y, weight)]``."""
    if _fused(a) and _fused(b):
        return list(torch._foreach_lerp(a, b, weight))
    return [torch.lerp(x, y, weight) for x, y in zip(a, b)]


def sqrt(a: Tensors) -> List[torch.Tensor]:
    """``[x.sqrt()]``."""
    if _fused(a):
        return list(torch._foreach_sqrt(a))
    return [x.sqrt() for x in a]


def norm(a: Tensors) -> List[torch.Tensor]:
    """``[torch.linalg.vector_norm(x)]`` (0-d tensors)."""
    if _fused(a):
        return list(torch._foreach_norm(a))
    return [torch.linalg.vector_norm(x) for x in a]


def by_dtype(fn, *lists: Tensors):
    """``fn(*sublists)`` for the tensors of each dtype and device (``fn`` returns a
    tuple of lists), reassembled in the original order."""
    keys = [(t.dtype, t.device) for t in lists[0]]
    groups = {}
    for i, key in enumerate(keys):
        groups.setdefault(key, []).append(i)
    if len(groups) <= 1:
        return tuple(list(out) for out in fn(*[list(x) for x in lists]))
    outputs = None
    for indices in groups.values():
        results = fn(*[[x[i] for i in indices] for x in lists])
        if outputs is None:
            outputs = [[None] * len(keys) for _ in results]
        for out, result in zip(outputs, results):
            for i, r in zip(indices, result):
                out[i] = r
    return tuple(outputs)
