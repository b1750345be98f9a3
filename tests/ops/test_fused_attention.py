"""The fused CPU attention kernels: values and derivatives (first and second order)
against autograd through the decomposed attention, vmap, and the compiled training
step with ``fused_attention=True`` against the eager step."""

import math

import pytest
import torch

import petfunc
from petfunc.compile import PatchUnavailableError
from petfunc.ops import fused_attention
from tests.helpers import training as tts
from tests.helpers.patches import patch


pytestmark = pytest.mark.skipif(fused_attention.library() is None, reason="no C++ compiler for the kernels")


def _decomposed(qkv, bias, heads, scale):
    """The attention of petfunc.model.transformer, written out: [A, t, 3d] -> [A, t, d]."""
    a, t, three_d = qkv.shape
    d = three_d // 3
    q, k, v = qkv.reshape(a, t, 3, heads, d // heads).unbind(2)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    weights = torch.softmax((q * scale) @ k.transpose(-1, -2) + bias[:, None, None, :], dim=-1)
    return (weights @ v).transpose(1, 2).reshape(a, t, d)


def _inputs(a, t, heads, width, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(a, t, 3 * heads * width, generator=g, dtype=dtype)
    # cutoff factors in (0, 1], some keys nearly cut off, as token_grid makes them
    factors = torch.rand(a, t, generator=g, dtype=dtype) ** 4
    bias = torch.log(factors.clamp_min(1e-15))
    return qkv.requires_grad_(), bias.requires_grad_()


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


# (atoms, slots, heads, head width): widths 8/16/32/64 run the unrolled kernels, 12
# the runtime-width one; slot counts off every multiple of 4, 8 and 16
SHAPES = [(3, 5, 2, 8), (4, 17, 8, 16), (2, 13, 3, 12), (2, 33, 2, 32), (2, 2, 1, 64), (5, 56, 8, 16)]


@pytest.mark.parametrize("shape", SHAPES, ids=[str(s) for s in SHAPES])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_value_and_two_derivatives_equal_autograd(shape, dtype):
    a, t, heads, width = shape
    scale = 1.0 / (math.sqrt(width) * 0.7)
    # float32: round-off relative to each array's largest entry; sums that cancel (the
    # bias gradient of two keys) came to 1e-5 over 40 random draws
    tol = 1e-12 if dtype == torch.float64 else 1e-4
    torch.manual_seed(1)
    qkv, bias = _inputs(a, t, heads, width, dtype)
    fused = fused_attention.attention(qkv, bias, heads, scale)
    reference = _decomposed(qkv, bias, heads, scale)
    assert _relative(fused, reference) < tol

    g = torch.randn_like(reference).requires_grad_()
    first = torch.autograd.grad(fused, (qkv, bias), g, create_graph=True)
    first_ref = torch.autograd.grad(reference, (qkv, bias), g, create_graph=True)
    for x, y in zip(first, first_ref):
        assert _relative(x, y) < tol

    # second order: the derivative of <first, cotangents> w.r.t. qkv, bias and g
    cot = [torch.randn_like(x) for x in first]
    second = torch.autograd.grad(sum((x * c).sum() for x, c in zip(first, cot)), (qkv, bias, g))
    second_ref = torch.autograd.grad(sum((x * c).sum() for x, c in zip(first_ref, cot)), (qkv, bias, g))
    for x, y in zip(second, second_ref):
        assert _relative(x, y) < tol


def test_third_derivative_and_forward_mode_equal_autograd():
    """Beyond the kernels' second order, the decomposed formulas take over: a third
    reverse derivative and forward mode through every order equal the decomposed
    attention's."""
    qkv, bias = _inputs(2, 6, 2, 8, torch.float64)

    def third(attend):
        out = attend(qkv, bias, 2, 0.3)
        (first,) = torch.autograd.grad(out.square().sum(), (qkv,), create_graph=True)
        (second,) = torch.autograd.grad(first.square().sum(), (qkv,), create_graph=True)
        return torch.autograd.grad(second.sum(), (qkv, bias))

    for x, y in zip(third(fused_attention.attention), third(_decomposed)):
        assert _relative(x, y) < 1e-12

    q0, b0 = qkv.detach(), bias.detach()

    def hvp(attend):
        def loss(x):
            return attend(x, b0, 2, 0.3).square().sum()

        # forward over reverse over reverse: jvp of the gradient of a gradient norm
        def grad_norm(x):
            return torch.func.grad(loss)(x).square().sum()

        return torch.func.jvp(torch.func.grad(grad_norm), (q0,), (torch.ones_like(q0),))[1]

    assert _relative(hvp(fused_attention.attention), hvp(_decomposed)) < 1e-12


def test_vmap_folds_the_batch_into_the_atoms():
    qkv = torch.randn(3, 4, 7, 48, dtype=torch.float64)
    bias = torch.randn(4, 7, dtype=torch.float64)

    def loss(x):
        return fused_attention.attention(x, bias, 2, 0.25).square().sum()

    values = torch.func.vmap(lambda x: fused_attention.attention(x, bias, 2, 0.25))(qkv)
    grads = torch.func.vmap(torch.func.grad(loss))(qkv)
    for i in range(3):
        assert _relative(values[i], _decomposed(qkv[i], bias, 2, 0.25)) < 1e-12
        x = qkv[i].clone().requires_grad_()
        (ref,) = torch.autograd.grad(_decomposed(x, bias, 2, 0.25).square().sum(), (x,))
        assert _relative(grads[i], ref) < 1e-12


def test_errors_name_the_problem():
    with pytest.raises(ValueError, match=r"qkv \[A, t, 3d\]"):
        fused_attention.attention_op(torch.zeros(2, 3, 10), torch.zeros(2, 3), 2, 1.0)
    with pytest.raises(ValueError, match=r"shape \(2, 3, 4\)"):
        fused_attention.attention_backward_op(
            torch.zeros(2, 3, 12), torch.zeros(2, 3), torch.zeros(2, 4, 4), 2, 1.0
        )
    with pytest.raises(TypeError, match="float32/float64"):
        fused_attention.attention_op(torch.zeros(2, 3, 12, dtype=torch.float16), torch.zeros(2, 3), 2, 1.0)


def _check_fused_train_step(dataset, fitted, backend):
    """The compiled step with the fused kernels equals the eager step on every batch
    shape of test_train_step (float64, 1e-9), from one graph; returns the graph's ops."""
    step, compiled, state = tts.warmed_up_compiled_step(
        dataset, fitted, backend=backend, fused_attention=True
    )
    assert compiled.fused_attention
    tts.check_compiled_train_step(step, compiled, state, dataset, fitted)
    return {str(n.target) for n in compiled.graph.graph.nodes}


def test_compiled_train_step_with_fused_attention_equals_eager(dataset, fitted):
    """aot_eager; the graph has the three kernels and no softmax."""
    ops = _check_fused_train_step(dataset, fitted, "aot_eager")
    assert {
        "petfunc.attention.default",
        "petfunc.attention_backward.default",
        "petfunc.attention_backward2.default",
    } <= ops
    assert not any("softmax" in op for op in ops)


# Slow: 47 s on a slow 2-core machine; test_compiled_train_step_with_fused_attention_equals_eager
# keeps a compiled fused-attention gradient in the default run.
@pytest.mark.slow
def test_compiled_hessian_loss_with_fused_attention(monkeypatch):
    """A Hessian-matching loss's parameter gradient (third order, vmap inside grad)
    compiled with the fused kernels equals the eager one (1e-9, float64)."""
    from tests.helpers import hessian_training as thl

    monkeypatch.setenv("PETFUNC_FUSED_ATTENTION", "1")
    model = petfunc.PET(thl.MINI)
    params, teacher = model.init(seed=0, dtype=torch.float64), model.init(seed=1, dtype=torch.float64)
    seen = []
    original = petfunc.compile

    def compile_and_check(*args, **kwargs):
        compiled = original(*args, **kwargs)
        seen.append({str(n.target) for n in compiled.graph.graph.nodes})
        return compiled

    monkeypatch.setattr(petfunc, "compile", compile_and_check)
    if not patch("layer_norm_decomposition").allowed():  # PETFUNC_STOCK_TORCH: refused, as documented
        with pytest.raises(PatchUnavailableError, match="layer_norm_decomposition"):
            thl.check_compiled(model.raw_energy, params, teacher, "aot_eager")
        return
    thl.check_compiled(model.raw_energy, params, teacher, "aot_eager")
    assert "petfunc.attention_backward2.default" in seen[0]


def test_fused_attention_is_for_the_cpu(dataset, fitted):
    params = tts.fitted_params(fitted, device="meta")
    batch = tts.batch_of(dataset, fitted, [0, 1]).to("meta")
    model = petfunc.PET(tts.CONFIG)
    with pytest.raises(ValueError, match="on the CPU"):
        petfunc.compile(
            lambda p, b: model.energy(p, b.positions, b.cell, b.neighbors),
            params,
            batch,
            fused_attention=True,
        )


@pytest.mark.slow
def test_inductor_compiled_train_step_with_fused_attention_equals_eager(dataset, fitted):
    """The same with inductor: the kernels run as fallback operators between
    inductor's generated kernels."""
    _check_fused_train_step(dataset, fitted, "inductor")
