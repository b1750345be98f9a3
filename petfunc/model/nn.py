"""Layer primitives as (init, apply) pairs over dict parameters.

Initialisations reproduce torch's defaults (``nn.Linear``: weight and bias
~ U(+-1/sqrt(fan_in)); ``nn.Embedding``: N(0, 1); norms: weight 1, bias 0) but draw
from an explicit ``torch.Generator``, never from the global RNG.
All apply functions are pure, differentiable twice, and traceable by ``make_fx``.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch._C._functorch import TransformType
from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters

from petfunc.ops.lookup import lookup_rows


Tensor = torch.Tensor


def _uniform(shape, bound: float, generator, dtype, device) -> Tensor:
    u = torch.rand(shape, generator=generator, dtype=torch.float64, device="cpu")
    return ((2.0 * u - 1.0) * bound).to(dtype=dtype, device=device)


def init_linear(d_in: int, d_out: int, generator, dtype, device, bias: bool = True):
    """Parameters of ``y = x W^T + b`` with W of shape [d_out, d_in]."""
    bound = 1.0 / math.sqrt(d_in) if d_in > 0 else 0.0
    params = {"weight": _uniform((d_out, d_in), bound, generator, dtype, device)}
    if bias:
        params["bias"] = _uniform((d_out,), bound, generator, dtype, device)
    return params


def linear(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """``x W^T + b`` over the last axis of x.

    Not ``F.linear``: under ``torch.func`` grad-of-grad with symbolic shapes its
    decomposition reads concrete sizes of >2-d inputs and bakes them into a trace.
    """
    weight, bias = params["weight"], params.get("bias")
    if weight.shape[0] == 1:
        # one output (the energy heads): a weighted sum, not an [n, d] x [d, 1] matmul.
        # The matmul's backward is an [n, 1] x [1, d] outer product, which inductor's
        # CPU decomposition guards on (n + d <= 32): a recompile for small batches
        # whenever d < 31
        out = (x * weight[0]).sum(dim=-1, keepdim=True)
        return out if bias is None else out + bias
    if bias is None:
        return torch.matmul(x, weight.t())
    if x.dim() == 2:
        return torch.addmm(bias, x, weight.t())
    return torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight.t()).reshape(*x.shape[:-1], weight.shape[0])


def init_embedding(num: int, dim: int, generator, dtype, device):
    """Embedding table [num, dim] ~ N(0, 1)."""
    w = torch.randn((num, dim), generator=generator, dtype=torch.float64, device="cpu")
    return {"weight": w.to(dtype=dtype, device=device)}


def init_norm(dim: int, kind: str, dtype, device):
    """RMSNorm (weight) or LayerNorm (weight and bias)."""
    params = {"weight": torch.ones(dim, dtype=dtype, device=device)}
    if kind == "LayerNorm":
        params["bias"] = torch.zeros(dim, dtype=dtype, device=device)
    return params


def rms_norm(params: dict[str, Tensor], x: Tensor) -> Tensor:
    """x / sqrt(mean(x^2) + eps) * weight, eps = machine epsilon of x's dtype."""
    return F.rms_norm(x, (x.shape[-1],), params["weight"], eps=torch.finfo(x.dtype).eps)


def _derivative_transforms():
    """The ``torch.func`` derivative transforms (``grad``/``vjp``: "Grad", ``jvp``:
    "Jvp") active around the current call, outermost first; vmaps are not listed."""
    kinds = {TransformType.Grad: "Grad", TransformType.Jvp: "Jvp"}
    return [kinds[i.key()] for i in retrieve_all_functorch_interpreters() if i.key() in kinds]


def layer_norm(params: dict[str, Tensor], x: Tensor, eps: float = 1e-5) -> Tensor:
    """``(x - mean) / sqrt(var + eps) * weight + bias`` over the last axis (biased var).

    PyTorch's fused layer norm has wrong derivatives beyond the second in reverse
    mode, and beyond the first wherever forward mode enters (a ``jvp`` of a ``jvp``,
    or a ``grad`` of a ``jvp``): its derivative formulas treat the saved mean and
    1/std as constants (pytorch/pytorch#175754, #196700; 1-4 % off in PET's
    parameter gradients of an HVP). Under such ``torch.func`` transforms the norm is
    written with elementary operations, whose derivatives are right to every order.
    Training (``grad`` of a ``grad``) keeps the fused kernel. Third derivatives taken
    with ``torch.autograd`` (``create_graph=True`` three times) cannot be seen here:
    take those with ``torch.func``.
    """
    transforms = _derivative_transforms() if torch._C._functorch.maybe_current_level() is not None else []
    if len(transforms) >= 3 or transforms in (["Grad", "Jvp"], ["Jvp", "Jvp"]):
        mean = x.mean(-1, keepdim=True)
        centered = x - mean
        variance = (centered * centered).mean(-1, keepdim=True)
        return centered * torch.rsqrt(variance + eps) * params["weight"] + params["bias"]
    return F.layer_norm(x, (x.shape[-1],), params["weight"], params["bias"], eps)


def norm(params: dict[str, Tensor], x: Tensor, kind: str) -> Tensor:
    return rms_norm(params, x) if kind == "RMSNorm" else layer_norm(params, x)


def init_feedforward(d_in: int, d_ff: int, activation: str, generator, dtype, device):
    """Two-layer FFN; with SwiGLU ``w_in`` maps to 2 d_ff (value and gate halves)."""
    d_hidden = 2 * d_ff if activation == "SwiGLU" else d_ff
    return {
        "w_in": init_linear(d_in, d_hidden, generator, dtype, device),
        "w_out": init_linear(d_ff, d_in, generator, dtype, device),
    }


def feedforward(params, x: Tensor, activation: str) -> Tensor:
    h = linear(params["w_in"], x)
    if activation == "SwiGLU":
        value, gate = h.chunk(2, dim=-1)
        # metatrain's gate is sigmoid(g), not SiLU(g)
        h = value * torch.sigmoid(gate)
    else:
        h = F.silu(h)
    return linear(params["w_out"], h)


def init_mlp2(d_in: int, d_hidden: int, d_out: int, generator, dtype, device):
    """``Sequential(Linear, SiLU, Linear)``: keys ``"0"`` and ``"2"`` as in torch."""
    return {
        "0": init_linear(d_in, d_hidden, generator, dtype, device),
        "2": init_linear(d_hidden, d_out, generator, dtype, device),
    }


def mlp2(params, x: Tensor, final_activation: bool = False) -> Tensor:
    y = linear(params["2"], F.silu(linear(params["0"], x)))
    return F.silu(y) if final_activation else y


def embedding(params: dict[str, Tensor], index: Tensor) -> Tensor:
    """Rows ``params["weight"][index]`` (see :func:`petfunc.ops.lookup.lookup_rows`)."""
    return lookup_rows(params["weight"], index)
