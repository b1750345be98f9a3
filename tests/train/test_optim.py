"""The optimizer: Adam and AdamW, the warm-up cosine schedule and gradient clipping,
against torch.optim and torch.nn.utils."""

import math

import pytest
import torch

import petfunc


F64 = torch.float64


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


# -----------------------------------------------------------------------------------
# AdamW with a weight-decay mask, against torch.optim.AdamW with two parameter groups


def nested_params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {
        "gnn": [
            {
                "linear": {
                    "weight": torch.randn(4, 3, generator=g, dtype=F64),
                    "bias": torch.randn(4, generator=g, dtype=F64),
                }
            }
        ],
        "norm": {
            "weight": torch.randn(3, generator=g, dtype=F64),
            "bias": torch.randn(3, generator=g, dtype=F64),
        },
        "embedding": torch.randn(5, 2, generator=g, dtype=F64),
    }


def gradients(step, seed=0):
    g = torch.Generator().manual_seed(100 * seed + step)
    return petfunc.tree.tree_map(lambda p: torch.randn(p.shape, generator=g, dtype=F64), nested_params())


def torch_adamw(params, decayed, lr, weight_decay, steps, seed=0):
    """The parameters after ``steps`` steps of ``torch.optim.AdamW``, the leaves whose
    path is in ``decayed`` with ``weight_decay`` and the others with 0."""
    flat = {k: torch.nn.Parameter(v.clone()) for k, v in petfunc.tree.flatten(params).items()}
    groups = [
        {"params": [p for k, p in flat.items() if k in decayed], "weight_decay": weight_decay},
        {"params": [p for k, p in flat.items() if k not in decayed], "weight_decay": 0.0},
    ]
    optimizer = torch.optim.AdamW(groups, lr=lr)
    for step in range(steps):
        for k, g in petfunc.tree.flatten(gradients(step, seed)).items():
            flat[k].grad = g.clone()
        optimizer.step()
    return {k: p.detach() for k, p in flat.items()}


def petfunc_adamw(optimizer, params, steps, seed=0):
    state = petfunc.TrainState(params, optimizer.init(params))
    for step in range(steps):
        state, _ = petfunc.apply_gradients(optimizer, state, gradients(step, seed))
    return petfunc.tree.flatten(state.params)


MATRICES = {"gnn.0.linear.weight", "embedding"}


@pytest.mark.parametrize(
    "mask, decayed",
    [
        (petfunc.train.weight_matrices, MATRICES),  # the default
        (lambda path, leaf: path.startswith("norm"), {"norm.weight", "norm.bias"}),
        (
            {
                "gnn": [{"linear": {"weight": True, "bias": False}}],
                "norm": {"weight": False, "bias": True},
                "embedding": False,
            },
            {"gnn.0.linear.weight", "norm.bias"},
        ),
        (None, set(petfunc.tree.flatten(nested_params()))),
    ],
    ids=["matrices", "predicate", "tree", "all"],
)
def test_masked_adamw_equals_torch_adamw_with_two_groups(mask, decayed):
    params = nested_params()
    got = petfunc_adamw(petfunc.adamw(0.01, weight_decay=0.1, mask=mask), params, 4)
    expected = torch_adamw(params, decayed, 0.01, 0.1, 4)
    for key, value in expected.items():
        assert torch.allclose(got[key], value, rtol=1e-12, atol=1e-15), key
    if mask is petfunc.train.weight_matrices:
        default = petfunc_adamw(petfunc.adamw(0.01, weight_decay=0.1), params, 4)
        assert all(torch.equal(default[k], got[k]) for k in got)


def test_masked_adamw_under_vmap_and_compile_equals_eager_members():
    optimizer = petfunc.adamw(0.01, weight_decay=0.1)
    members = [nested_params(seed) for seed in (0, 1)]

    def step(state, grads):
        return petfunc.apply_gradients(optimizer, state, grads)[0]

    states = [petfunc.TrainState(p, optimizer.init(p)) for p in members]
    grads = [gradients(0, seed) for seed in (0, 1)]
    stacked = torch.func.vmap(step)(petfunc.tree.stack(states), petfunc.tree.stack(grads))
    compiled = petfunc.compile(step, states[0], grads[0], backend="aot_eager")
    for i, (state, g) in enumerate(zip(states, grads)):
        eager = petfunc.tree.flatten(step(state, g).params)
        by_vmap = petfunc.tree.flatten(petfunc.tree.unstack(stacked.params)[i])
        by_compile = petfunc.tree.flatten(compiled(state, g).params)
        reference = torch_adamw(members[i], MATRICES, 0.01, 0.1, 1, seed=i)
        for key in eager:
            assert torch.allclose(eager[key], reference[key], rtol=1e-12, atol=1e-15), key
            assert torch.allclose(by_vmap[key], eager[key], rtol=1e-13, atol=1e-15), key
            assert torch.allclose(by_compile[key], eager[key], rtol=1e-13, atol=1e-15), key


def test_adamw_refuses_a_mask_of_another_structure():
    optimizer = petfunc.adamw(0.01, weight_decay=0.1, mask={"norm": {"weight": True}})
    params = nested_params()
    with pytest.raises(
        ValueError, match=r"weight-decay mask is not shaped like the parameters: trees differ at"
    ):
        optimizer.update(gradients(0), optimizer.init(params), params=params)
    with pytest.raises(ValueError, match=r"weight_decay must be >= 0"):
        petfunc.adamw(0.01, weight_decay=-1.0)
