"""The optimizer: Adam and AdamW, the warm-up cosine schedule and gradient clipping,
against torch.optim and torch.nn.utils."""

import math

import pytest
import torch

import petfunc


def test_schedule_and_clipping_match_torch():
    # metatrain: LambdaLR with warm-up then cosine; lr(0) = 0
    schedule = petfunc.warmup_cosine(1e-3, 200, 0.1)
    assert schedule(0).item() == 0.0
    assert math.isclose(schedule(10).item(), 1e-3 * 10 / 20)
    assert math.isclose(schedule(20).item(), 1e-3)
    assert math.isclose(schedule(110).item(), 1e-3 * 0.5 * (1 + math.cos(math.pi * 90 / 180)))
    # clip_by_global_norm == torch.nn.utils.clip_grad_norm_
    g = {"a": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(7, dtype=torch.float64)}
    tensors = [g["a"].clone(), g["b"].clone()]
    for t in tensors:
        t.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(tensors, 0.5)
    clipped, norm = petfunc.train.clip_by_global_norm(g, 0.5)
    assert torch.allclose(clipped["a"], tensors[0].grad, rtol=1e-14)
    assert torch.allclose(clipped["b"], tensors[1].grad, rtol=1e-14)


def test_adam_step_matches_torch_optim():
    # one functional step against torch.optim.Adam with the same lr and clipping
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    optimizer = petfunc.make_optimizer(0.01)
    state = petfunc.TrainState(params, optimizer.init(params))
    reference = [torch.nn.Parameter(params["w"].clone()), torch.nn.Parameter(params["b"].clone())]
    torch_opt = torch.optim.Adam(reference, lr=0.01)
    for _ in range(3):
        grads = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
        state, _ = petfunc.apply_gradients(optimizer, state, grads, grad_clip_norm=1.0)
        reference[0].grad, reference[1].grad = grads["w"].clone(), grads["b"].clone()
        torch.nn.utils.clip_grad_norm_(reference, 1.0)
        torch_opt.step()
    assert torch.allclose(state.params["w"], reference[0].detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(state.params["b"], reference[1].detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("weight_decay", [None, 0.01])
def test_adamw_matches_torch_with_mixed_order_and_dtypes(weight_decay):
    # Adam and AdamW equal torch.optim with one dtype and with mixed dtypes, and the
    # gradient tree may list its keys in another order than the parameters
    for dtypes in [(torch.float64, torch.float64), (torch.float64, torch.float32)]:
        params = {"w": torch.randn(4, 3, dtype=dtypes[0]), "b": {"c": torch.randn(3, dtype=dtypes[1])}}
        optimizer = petfunc.make_optimizer(0.01, weight_decay=weight_decay)
        state = petfunc.TrainState(params, optimizer.init(params))
        reference = [torch.nn.Parameter(params["w"].clone()), torch.nn.Parameter(params["b"]["c"].clone())]
        kind = torch.optim.Adam if weight_decay is None else torch.optim.AdamW
        torch_opt = kind(
            reference, lr=0.01, **({} if weight_decay is None else {"weight_decay": weight_decay})
        )
        for _ in range(3):
            grads = {"b": {"c": torch.randn(3, dtype=dtypes[1])}, "w": torch.randn(4, 3, dtype=dtypes[0])}
            state, _ = petfunc.apply_gradients(optimizer, state, grads, grad_clip_norm=None)
            reference[0].grad, reference[1].grad = grads["w"].clone(), grads["b"]["c"].clone()
            torch_opt.step()
        rtol = 1e-12 if dtypes[1] == torch.float64 else 1e-5
        assert torch.allclose(state.params["w"], reference[0].detach(), rtol=rtol, atol=1e-7)
        assert torch.allclose(state.params["b"]["c"], reference[1].detach(), rtol=rtol, atol=1e-7)
        assert state.opt_state.mu["b"]["c"].shape == (3,) and state.opt_state.nu["w"].shape == (4, 3)
