"""PET's attention as three CPU kernels: the attention, its derivative and the
derivative of that derivative, each one pass over the atoms.

The decomposed attention (:func:`petfunc.ops.attention.grid_attention`) materialises
``[atoms, heads, t, t]`` grids: scores, weights, and in force training about a dozen
more for the derivatives and their derivatives. For a periodic batch these grids are
tens of MB each, so every pass over them runs at memory speed. The kernels of
``_attention.cpp`` compute one atom and head at a time, keep its blocks in cache and store
only what has the tokens' shape: ``qkv [A, t, 3d]``, ``bias [A, t]``, output
``[A, t, d]``. The formulas are in that file's header.

They are used where :func:`petfunc.compile` is asked for them
(``fused_attention=True``, a CPU function) while it traces (:func:`enabled`): the
transformer's attention then enters the graph as three custom operators
(``petfunc::attention``, ``petfunc::attention_backward``,
``petfunc::attention_backward2``): the value, the derivative (forces) and the
derivative of that (a force- or stress-trained step's parameter gradient). Any
derivative beyond those, a third one or forward mode, is computed from the
decomposed attention's formulas on the saved inputs; vmap (ensembles) folds the
vmapped dimension into the atoms.

On the default PET's compiled training step they run at the speed of the
decomposed attention with less peak memory (docs/performance.md). The grids grow
with the square of the neighbour count, so the saving grows with it. On a CPU
without AVX-512 the kernels use 32-byte vectors (with 64-byte vectors there the
products' accumulators spilled to memory).

The library is built with the system's C++ compiler at first use
(:mod:`petfunc.ops.attention_library`); where it cannot be built, a warning says so
and the decomposed attention is used.
"""

from __future__ import annotations

import threading

import torch

from petfunc.ops.attention import grid_attention
from petfunc.ops.attention_library import library


_SUFFIX = {torch.float32: "f32", torch.float64: "f64"}


def _kernel(name: str, dtype: torch.dtype):
    lib = library()
    if lib is None:
        raise RuntimeError("petfunc: the fused attention kernels are not available on this machine")
    return getattr(lib, f"petfunc_attention_{name}_{_SUFFIX[dtype]}")


def _check(qkv, bias, heads, *like):
    """Dtypes, device and shapes; ``like`` are (tensor, "qkv" | "bias" | "out") pairs
    that must have the shape of qkv, bias or the output (the kernels trust them)."""
    if qkv.device.type != "cpu" or qkv.dtype not in _SUFFIX or bias.dtype != qkv.dtype:
        raise TypeError(f"fused attention: float32/float64 CPU tensors only, got {qkv.dtype} on {qkv.device}")
    if qkv.dim() != 3 or qkv.shape[2] % (3 * heads) or tuple(bias.shape) != tuple(qkv.shape[:2]):
        raise ValueError(
            f"fused attention: qkv [A, t, 3d] and bias [A, t], got {tuple(qkv.shape)}, {tuple(bias.shape)}"
        )
    shapes = {"qkv": tuple(qkv.shape), "bias": tuple(bias.shape), "out": (*qkv.shape[:2], qkv.shape[2] // 3)}
    for tensor, kind in like:
        if tuple(tensor.shape) != shapes[kind] or tensor.dtype != qkv.dtype or tensor.device != qkv.device:
            raise ValueError(
                f"fused attention: expected a {qkv.dtype} CPU tensor of shape {shapes[kind]}, "
                f"got {tensor.dtype} {tuple(tensor.shape)} on {tensor.device}"
            )


def _sizes(qkv, heads, scale):
    a, t, three_d = qkv.shape
    return [a, t, heads, three_d // (3 * heads), float(scale), torch.get_num_threads()]


def _ptr(x: torch.Tensor) -> int:
    return x.data_ptr()


# ---------------------------------------------------------------------------------------
# the operators (opaque to make_fx and inductor)


@torch.library.custom_op("petfunc::attention", mutates_args=())
def attention_op(qkv: torch.Tensor, bias: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """``[A, t, d]`` attention output of ``qkv [A, t, 3d]`` (layout ``[3, heads, d/heads]``
    per slot) with key bias ``[A, t]``; scores ``scale * q . k + bias``."""
    _check(qkv, bias, heads)
    qkv, bias = qkv.contiguous(), bias.contiguous()
    out = qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)
    if out.numel():
        _kernel("forward", qkv.dtype)(_ptr(qkv), _ptr(bias), _ptr(out), *_sizes(qkv, heads, scale))
    return out


@attention_op.register_fake
def _(qkv, bias, heads, scale):
    return qkv.new_empty(qkv.shape[0], qkv.shape[1], qkv.shape[2] // 3)


@torch.library.custom_op("petfunc::attention_backward", mutates_args=())
def attention_backward_op(
    qkv: torch.Tensor, bias: torch.Tensor, grad: torch.Tensor, heads: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cotangents of ``qkv`` and ``bias`` for the output cotangent ``grad [A, t, d]``."""
    _check(qkv, bias, heads, (grad, "out"))
    qkv, bias, grad = qkv.contiguous(), bias.contiguous(), grad.contiguous()
    gqkv, gbias = torch.empty_like(qkv), torch.empty_like(bias)
    if qkv.numel():
        _kernel("backward", qkv.dtype)(
            _ptr(qkv), _ptr(bias), _ptr(grad), _ptr(gqkv), _ptr(gbias), *_sizes(qkv, heads, scale)
        )
    return gqkv, gbias


@attention_backward_op.register_fake
def _(qkv, bias, grad, heads, scale):
    return torch.empty_like(qkv), torch.empty_like(bias)


@torch.library.custom_op("petfunc::attention_backward2", mutates_args=())
def attention_backward2_op(
    qkv: torch.Tensor,
    bias: torch.Tensor,
    grad: torch.Tensor,
    cot_qkv: torch.Tensor,
    cot_bias: torch.Tensor,
    heads: int,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cotangents of ``(qkv, bias, grad)`` for the map ``attention_backward``, given the
    cotangents ``cot_qkv``, ``cot_bias`` of its outputs."""
    _check(qkv, bias, heads, (grad, "out"), (cot_qkv, "qkv"), (cot_bias, "bias"))
    qkv, bias, grad = qkv.contiguous(), bias.contiguous(), grad.contiguous()
    cot_qkv, cot_bias = cot_qkv.contiguous(), cot_bias.contiguous()
    out_qkv, out_bias, out_grad = torch.empty_like(qkv), torch.empty_like(bias), torch.empty_like(grad)
    if qkv.numel():
        _kernel("backward2", qkv.dtype)(
            _ptr(qkv),
            _ptr(bias),
            _ptr(grad),
            _ptr(cot_qkv),
            _ptr(cot_bias),
            _ptr(out_qkv),
            _ptr(out_bias),
            _ptr(out_grad),
            *_sizes(qkv, heads, scale),
        )
    return out_qkv, out_bias, out_grad


@attention_backward2_op.register_fake
def _(qkv, bias, grad, cot_qkv, cot_bias, heads, scale):
    return torch.empty_like(qkv), torch.empty_like(bias), torch.empty_like(grad)


# ---------------------------------------------------------------------------------------
# differentiation and vmap


def _fold(args, in_dims, batch_size):
    """Move every vmapped dimension to the front and merge it into the atoms."""
    out = []
    for x, d in zip(args, in_dims):
        if d is None:
            x = x.unsqueeze(0).expand(batch_size, *x.shape)
        else:
            x = x.movedim(d, 0)
        out.append(x.reshape(batch_size * x.shape[1], *x.shape[2:]))
    return out


def _unfold(x, batch_size):
    return x.reshape(batch_size, x.shape[0] // batch_size, *x.shape[1:])


def decomposed(qkv, bias, heads: int, scale: float):
    """The same attention from torch ops (:func:`petfunc.ops.attention.grid_attention`)."""
    a, t, three_d = qkv.shape
    return grid_attention(qkv.reshape(a * t, three_d), bias, heads, scale).reshape(a, t, three_d // 3)


def _decomposed_backward(qkv, bias, grad, heads, scale):
    return torch.func.vjp(lambda x, b: decomposed(x, b, heads, scale), qkv, bias)[1](grad)


def _decomposed_backward2(qkv, bias, grad, cot_qkv, cot_bias, heads, scale):
    _, vjp = torch.func.vjp(lambda x, b, g: _decomposed_backward(x, b, g, heads, scale), qkv, bias, grad)
    return vjp((cot_qkv, cot_bias))


def _tangents(primals, tangents):
    """``tangents`` (or cotangents) with each absent one (None) a zero like its primal."""
    return tuple(torch.zeros_like(p) if t is None else t for p, t in zip(primals, tangents))


# The kernels give the value, the derivative and the derivative of that; any
# derivative beyond (a third one, forward mode: Hessian-vector products, jacfwd)
# comes from the decomposed attention's math on the saved inputs: right at every
# order, at the speed of the decomposed attention.


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(qkv, bias, heads, scale):
        return attention_op(qkv, bias, heads, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        qkv, bias, heads, scale = inputs
        ctx.save_for_backward(qkv, bias)
        ctx.save_for_forward(qkv, bias)
        ctx.heads, ctx.scale = heads, scale

    @staticmethod
    def backward(ctx, grad):
        qkv, bias = ctx.saved_tensors
        gqkv, gbias = _AttentionBackward.apply(qkv, bias, grad, ctx.heads, ctx.scale)
        return gqkv, gbias, None, None

    @staticmethod
    def jvp(ctx, qkv_dot, bias_dot, *_):
        primals = ctx.saved_tensors
        return torch.func.jvp(
            lambda x, b: decomposed(x, b, ctx.heads, ctx.scale),
            primals,
            _tangents(primals, (qkv_dot, bias_dot)),
        )[1]

    @staticmethod
    def vmap(info, in_dims, qkv, bias, heads, scale):
        qkv, bias = _fold((qkv, bias), in_dims[:2], info.batch_size)
        return _unfold(_Attention.apply(qkv, bias, heads, scale), info.batch_size), 0


class _AttentionBackward(torch.autograd.Function):
    @staticmethod
    def forward(qkv, bias, grad, heads, scale):
        return attention_backward_op(qkv, bias, grad, heads, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        qkv, bias, grad, heads, scale = inputs
        ctx.save_for_backward(qkv, bias, grad)
        ctx.save_for_forward(qkv, bias, grad)
        ctx.heads, ctx.scale = heads, scale

    @staticmethod
    def backward(ctx, cot_qkv, cot_bias):
        qkv, bias, grad = ctx.saved_tensors
        cot_qkv, cot_bias = _tangents((qkv, bias), (cot_qkv, cot_bias))
        out = _AttentionBackward2.apply(qkv, bias, grad, cot_qkv, cot_bias, ctx.heads, ctx.scale)
        return (*out, None, None)

    @staticmethod
    def jvp(ctx, qkv_dot, bias_dot, grad_dot, *_):
        primals = ctx.saved_tensors
        return torch.func.jvp(
            lambda x, b, g: _decomposed_backward(x, b, g, ctx.heads, ctx.scale),
            primals,
            _tangents(primals, (qkv_dot, bias_dot, grad_dot)),
        )[1]

    @staticmethod
    def vmap(info, in_dims, qkv, bias, grad, heads, scale):
        args = _fold((qkv, bias, grad), in_dims[:3], info.batch_size)
        out = _AttentionBackward.apply(*args, heads, scale)
        return tuple(_unfold(x, info.batch_size) for x in out), (0, 0)


class _AttentionBackward2(torch.autograd.Function):
    @staticmethod
    def forward(qkv, bias, grad, cot_qkv, cot_bias, heads, scale):
        return attention_backward2_op(qkv, bias, grad, cot_qkv, cot_bias, heads, scale)

    @staticmethod
    def setup_context(ctx, inputs, output):
        *tensors, heads, scale = inputs
        ctx.save_for_backward(*tensors)
        ctx.save_for_forward(*tensors)
        ctx.heads, ctx.scale = heads, scale

    @staticmethod
    def backward(ctx, *cotangents):
        primals = ctx.saved_tensors
        _, vjp = torch.func.vjp(lambda *x: _decomposed_backward2(*x, ctx.heads, ctx.scale), *primals)
        return (*vjp(_tangents(primals[:3], cotangents)), None, None)

    @staticmethod
    def jvp(ctx, *tangents):
        primals = ctx.saved_tensors
        return torch.func.jvp(
            lambda *x: _decomposed_backward2(*x, ctx.heads, ctx.scale),
            primals,
            _tangents(primals, tangents[:5]),
        )[1]

    @staticmethod
    def vmap(info, in_dims, qkv, bias, grad, cot_qkv, cot_bias, heads, scale):
        args = _fold((qkv, bias, grad, cot_qkv, cot_bias), in_dims[:5], info.batch_size)
        out = _AttentionBackward2.apply(*args, heads, scale)
        return tuple(_unfold(x, info.batch_size) for x in out), (0, 0, 0)


def attention(qkv: torch.Tensor, bias: torch.Tensor, heads: int, scale: float) -> torch.Tensor:
    """Differentiable fused attention: ``qkv [A, t, 3d]``, key bias ``[A, t]`` ->
    ``[A, t, d]`` (see the module docstring)."""
    return _Attention.apply(qkv, bias, heads, scale)


# ---------------------------------------------------------------------------------------
# where it is used

_state = threading.local()


def enabled() -> bool:
    """True inside :func:`use` (set by :func:`petfunc.compile` while it traces for the CPU)."""
    return getattr(_state, "on", False)


class use:
    """``with use(True):`` the transformer's attention is traced as the fused operators."""

    def __init__(self, on: bool):
        self.on = bool(on)

    def __enter__(self):
        self.previous = enabled()
        _state.on = self.on
        return self

    def __exit__(self, *exc):
        _state.on = self.previous
