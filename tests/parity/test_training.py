"""Training against metatrain's trainer code: parameter gradients of the loss for
random architectures, the loss and its gradients against metatrain's
LossAggregator, and the learning-rate schedule."""

import dataclasses

import numpy as np
import pytest
import torch


pytest.importorskip("metatrain")

import petfunc
from tests.helpers.parity import (
    assert_gradients_equal,
    conditioned,
    metatrain_training_outputs,
    random_config,
    random_params,
    random_structure,
)


@pytest.mark.parametrize(
    "seed,autodiff,per_atom,override",
    [(seed, autodiff, True, {}) for seed in range(4) for autodiff in ("func", "autograd")]
    + [
        (4, "func", False, {}),
        (5, "autograd", False, {}),
        # no attention layer; no GNN layer (the embeddings read out)
        (6, "func", True, {"num_attention_layers": 0}),
        (7, "func", True, {"num_gnn_layers": 0, "featurizer_type": "feedforward"}),
    ],
)
def test_random_architecture_training_gradients(seed, autodiff, per_atom, override):
    """Parameter gradients of the energy + forces + strain-derivative loss equal
    metatrain's training-mode gradients (its evaluate_model, create_graph=True,
    loss.backward) for random architectures on random labelled batches; with
    ``per_atom=False`` the energy and strain terms compare whole structures
    (metatrain's per_structure_targets: average_by_num_atoms leaves them whole)."""
    import random

    from petfunc.data import make_batch, sample_from_atoms

    rng = random.Random(100 + seed)
    config = dataclasses.replace(random_config(rng), **override)
    frames = [random_structure(rng, config.atomic_types) for _ in range(rng.randint(2, 4))]
    if seed % 2 == 1:
        config, frames = conditioned(config, frames, random.Random(2000 + seed))
    params = random_params(config, seed=seed)
    labels = np.random.default_rng(seed)
    samples = []
    for atoms in frames:
        s = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        s.energy = float(10 * labels.normal())
        s.forces = labels.normal(size=(len(atoms), 3))
        s.virial = labels.normal(size=(3, 3))
        samples.append(s)
    flat = petfunc.tree.flatten(params)
    batch = make_batch(
        samples,
        config,
        flat["composition_weights"].numpy(),
        float(flat["energy_scale"]),
        dtype=torch.float64,
        pad=False,
    )
    weights = petfunc.LossWeights.make(energy=1.0, forces=2.0, stress=0.5, per_atom=per_atom)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(config), weights, autodiff)(params, batch)

    model, systems, info, predicted = metatrain_training_outputs(config, params, frames)
    out = predicted.block()
    n = torch.tensor([len(a) for a in frames], dtype=torch.float64)
    if not per_atom:
        n = torch.ones_like(n)
    loss = (
        ((out.values[:, 0] - batch.energy) / n).pow(2).mean()
        + 2.0 * (out.gradient("positions").values[:, :, 0] + batch.forces).pow(2).mean()
        + 0.5
        * ((out.gradient("strain").values[:, :, :, 0] - batch.strain_derivative) / n[:, None, None])
        .pow(2)
        .mean()
    )
    loss.backward()
    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * loss.item()
    assert_gradients_equal(grads, model)


LOSS_FORMS = [
    "huber",
    {
        "energy": {
            "type": "mae",
            "weight": 2.0,
            "forces": {"type": "huber", "delta": 0.3, "weight": 3.0},
            "stress": {"type": "mse", "weight": 0.5},
        }
    },
    {
        "energy": {
            "type": "huber",
            "delta": 0.05,
            "reduction": "sum",
            "gradients": {"positions": {"reduction": "sum"}, "strain": {"type": "mae", "reduction": "sum"}},
        }
    },
]


def _target_block(template, energy, forces, strain_derivative):
    """A metatensor block of labels shaped like metatrain's prediction ``template``
    (energies, and their position and strain gradients)."""
    from metatensor.torch import TensorBlock

    block = TensorBlock(
        values=energy[:, None], samples=template.samples, components=[], properties=template.properties
    )
    for name, values in (("positions", -forces), ("strain", strain_derivative)):
        gradient = template.gradient(name)
        block.add_gradient(
            name,
            TensorBlock(
                values=values[..., None].clone(),
                samples=gradient.samples,
                components=gradient.components,
                properties=gradient.properties,
            ),
        )
    return block


@pytest.mark.parametrize("per_atom", [True, False], ids=["per_atom", "per_structure"])
@pytest.mark.parametrize("form", range(len(LOSS_FORMS)), ids=["huber", "mixed", "sum"])
def test_loss_equals_metatrains_loss_aggregator(form, per_atom):
    """The loss and its parameter gradients equal those of metatrain's own trainer
    code, not a re-statement of it: metatrain's expand_loss_config on the loss option,
    its average_by_num_atoms on predictions and labels (per_structure_targets: energy
    when per_atom is off), and its LossAggregator (mse, mae and huber terms with
    their deltas, weights and reductions), on labels with NaN entries, which both
    skip. Random architecture and structures, float64, gradients to 1e-10."""
    import random

    from metatensor.torch import TensorMap
    from metatrain.utils.loss import LossAggregator
    from metatrain.utils.omegaconf import expand_loss_config
    from metatrain.utils.per_atom import average_by_num_atoms
    from omegaconf import OmegaConf

    from petfunc.data import make_batch, sample_from_atoms
    from petfunc.trainer.options import parse_loss

    rng = random.Random(300 + form)
    config = random_config(rng)
    frames = [random_structure(rng, config.atomic_types) for _ in range(rng.randint(3, 5))]
    params = random_params(config, seed=form)
    labels = np.random.default_rng(form)
    samples = []
    for n, atoms in enumerate(frames):
        s = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        s.energy = float(labels.normal()) if n != 1 else float("nan")
        s.forces = labels.normal(size=(len(atoms), 3))
        s.forces[labels.random(size=s.forces.shape) < 0.2] = np.nan
        s.virial = labels.normal(size=(3, 3)) if n != 2 else np.full((3, 3), np.nan)
        samples.append(s)
    flat = petfunc.tree.flatten(params)
    batch = make_batch(
        samples,
        config,
        flat["composition_weights"].numpy(),
        float(flat["energy_scale"]),
        dtype=torch.float64,
        pad=False,
    )
    assert torch.isnan(batch.energy).any() and torch.isnan(batch.forces).any()

    spec = LOSS_FORMS[form]
    targets = {"energy": {"quantity": "energy", "forces": {"key": "forces"}, "stress": {"key": "stress"}}}
    conf = OmegaConf.create(
        {"training_set": [{"targets": targets}], "architecture": {"training": {"loss": spec}}}
    )
    loss_config = OmegaConf.to_container(expand_loss_config(conf)["architecture"]["training"]["loss"])
    weights, _ = parse_loss(spec)
    weights = petfunc.LossWeights(weights.energy, weights.forces, weights.stress, per_atom=per_atom)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(config), weights, "func")(params, batch)

    model, systems, info, predicted = metatrain_training_outputs(config, params, frames)
    target = TensorMap(
        predicted.keys,
        [_target_block(predicted.block(), batch.energy, batch.forces, batch.strain_derivative)],
    )
    per_structure = [] if per_atom else ["energy"]
    predictions = average_by_num_atoms({"energy": predicted}, systems, per_structure)
    references = average_by_num_atoms({"energy": target}, systems, per_structure)
    loss = LossAggregator({"energy": info}, loss_config)(predictions, references)
    loss.backward()

    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * abs(loss.item()), (
        loss.item(),
        metrics["loss"],
    )
    assert_gradients_equal(grads, model)


@pytest.mark.parametrize(
    "epochs,steps_per_epoch,warmup_fraction",
    [(1, 1, 0.01), (3, 7, 0.1), (50, 13, 0.01), (10, 4, 0.0), (2, 5, 0.5)],
)
def test_schedule_equals_metatrains(epochs, steps_per_epoch, warmup_fraction):
    """petfunc.warmup_cosine(lr, T, f) against the learning rates of metatrain's PET
    trainer (its get_scheduler: LambdaLR, stepped once per batch) at every step."""
    from metatrain.pet.trainer import get_scheduler

    learning_rate = 3e-4
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([weight], lr=learning_rate)
    hypers = {"num_epochs": epochs, "warmup_fraction": warmup_fraction}
    scheduler = get_scheduler(optimizer, hypers, steps_per_epoch)
    schedule = petfunc.warmup_cosine(learning_rate, epochs * steps_per_epoch, warmup_fraction)
    for step in range(epochs * steps_per_epoch):
        expected = optimizer.param_groups[0]["lr"]  # the rate of this step's update
        assert abs(schedule(step).item() - expected) <= 1e-15 * learning_rate, step
        optimizer.step()
        scheduler.step()
