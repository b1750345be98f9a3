"""Training on Hessian-vector products: the loss, its (third-derivative) parameter
gradient against finite differences, and compiled == eager."""

import pytest
import torch

import petfunc
from petfunc.train.hessian_loss import (
    hessian_batch,
    make_hessian_grad_step,
    make_hessian_loss,
    make_hessian_train_step,
)
from tests.helpers import toy
from tests.helpers.hessian_training import F64, MINI, WEIGHTS, check_compiled, hessian_batch_of
from tests.helpers.patches import needs_patches


@needs_patches("layer_norm_decomposition")
def test_hvp_term_is_the_model_hessian():
    model = petfunc.PET(MINI)
    params = model.init(seed=0, dtype=F64)
    hb = hessian_batch_of(model.raw_energy, params, 3, 0)
    loss_fn = make_hessian_loss(model, WEIGHTS, hvp_weight=5.0)
    loss, metrics = loss_fn(params, hb)
    # labels are the model's own HVPs: that term vanishes, the others are make_loss's
    assert float(metrics["hvp_loss"]) < 1e-24
    ref_loss, ref_metrics = petfunc.make_loss(model, WEIGHTS)(params, hb.batch)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0)
    for key, value in ref_metrics.items():
        torch.testing.assert_close(metrics[key], value, rtol=1e-12, atol=1e-300, msg=key)
    assert int(metrics["hvp_count"]) == hb.hvp.numel()


@needs_patches("layer_norm_decomposition")
def test_parameter_gradient_matches_finite_differences():
    model = petfunc.PET(MINI)
    teacher = model.init(seed=1, dtype=F64)
    params = model.init(seed=0, dtype=F64)
    hb = hessian_batch_of(model.raw_energy, teacher, 2, 1)
    loss_fn = make_hessian_loss(model, WEIGHTS, hvp_weight=3.0)
    grads, metrics = make_hessian_grad_step(model, WEIGHTS, hvp_weight=3.0)(params, hb)
    assert float(metrics["hvp_loss"]) > 0
    # central differences along a random direction of the trainable parameters
    g = torch.Generator().manual_seed(0)
    direction = petfunc.tree.tree_map(lambda t: torch.randn(t.shape, generator=g, dtype=F64), grads)
    analytic = sum(
        float((a * d).sum())
        for a, d in zip(petfunc.tree.tree_leaves(grads), petfunc.tree.tree_leaves(direction))
    )

    def loss_at(step):
        moved = petfunc.tree.tree_map(lambda p, d: p + step * d, petfunc.train.trainable(params), direction)
        return float(loss_fn({**params, **moved}, hb)[0])

    step = 1e-5
    numeric = (loss_at(step) - loss_at(-step)) / (2 * step)
    assert abs(numeric - analytic) < 1e-7 * abs(analytic), f"numeric: {numeric}, analytical: {analytic}"


@needs_patches("layer_norm_decomposition")
def test_training_on_hessians_reduces_the_hvp_error():
    model = petfunc.PET(MINI)
    teacher = model.init(seed=1, dtype=F64)
    params = model.init(seed=0, dtype=F64)
    hb = hessian_batch_of(model.raw_energy, teacher, 2, 2)
    optimizer = petfunc.make_optimizer(1e-2)
    state = petfunc.init_state(params, optimizer)
    step = make_hessian_train_step(model, optimizer, petfunc.LossWeights.make(0.0, 0.0, 0.0), hvp_weight=1.0)
    first = None
    for _ in range(5):
        state, metrics = step(state, hb)
        first = float(metrics["hvp_loss"]) if first is None else first
    assert float(metrics["hvp_loss"]) < first


def test_hessian_batch_checks_shapes():
    batch = toy.labelled_batch(MINI, 2, 0)
    with pytest.raises(ValueError, match="n_probes"):
        hessian_batch(batch, torch.zeros(3, 2), torch.zeros(3, 2))
    one = hessian_batch(
        batch, torch.ones_like(batch.positions), 2 * torch.ones_like(batch.positions), scale=2.0
    )
    assert one.directions.shape == (1,) + tuple(batch.positions.shape)
    assert torch.equal(one.hvp, torch.ones_like(one.directions))


@needs_patches("layer_norm_decomposition")
def test_compiled_toy_hessian_loss_aot_eager():
    check_compiled(toy.energy, toy.init(seed=0), toy.init(seed=1), "aot_eager")


@needs_patches("layer_norm_decomposition")
@pytest.mark.slow
def test_compiled_pet_hessian_loss_aot_eager():
    model = petfunc.PET(MINI)
    worst = check_compiled(
        model.raw_energy, model.init(seed=0, dtype=F64), model.init(seed=1, dtype=F64), "aot_eager"
    )
    print(f"PET Hessian loss aot_eager: max relative error {worst:.1e}")
