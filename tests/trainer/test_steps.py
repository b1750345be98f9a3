"""The step functions: a split step applies nothing when its loss is not finite, and
eager steps have no compiled graphs to count."""

import math

import torch

from petfunc.train import TrainState
from petfunc.trainer.steps import TrainStep, Validate


def test_a_split_step_applies_only_finite_steps():
    applied = []

    def grad_step(params, batch):
        return {"w": torch.ones(1)}, {"loss": torch.tensor(batch)}

    def apply(state, grads):
        applied.append(grads)
        return TrainState({"w": state.params["w"] - grads["w"]}, state.opt_state)

    step = TrainStep(grad_step, apply)
    state = TrainState({"w": torch.zeros(1)}, ())
    # A diverged step leaves the state as it was (the loop stops on its loss).
    same, metrics = step(state, float("nan"))
    assert same is state and math.isnan(metrics["loss"]) and applied == []
    new, metrics = step(state, 2.0)
    assert metrics == {"loss": 2.0} and len(applied) == 1
    assert torch.equal(new.params["w"], torch.tensor([-1.0]))
    # Eager: no compiled graphs to count (fit reports none).
    assert not hasattr(step, "num_graphs")


def test_a_fused_step_and_the_validation_loss_give_floats():
    def train_step(state, batch):
        return TrainState({"w": state.params["w"] + 1}, ()), {"loss": torch.tensor(0.5, dtype=torch.float32)}

    state, metrics = TrainStep(train_step)(TrainState({"w": torch.zeros(2)}, ()), None)
    assert torch.equal(state.params["w"], torch.ones(2)) and metrics == {"loss": 0.5}
    validate = Validate(
        lambda params, batch: (None, {"loss": params["w"].sum(), "energy_count": torch.tensor(3)})
    )
    assert not hasattr(validate, "num_graphs")  # built on its first batch
    assert validate({"w": torch.ones(2)}, None) == {"loss": 2.0, "energy_count": 3.0}
    assert not hasattr(validate, "num_graphs")
