"""The training loss: padding structures and NaN labels skipped, the loss types
equal to torch's, an energy-only loss without position derivatives, and ZBL removed
from the targets."""

import math

import pytest
import torch

import petfunc
from petfunc.data import make_batch, zbl_baseline
from petfunc.derivatives import energy_forces_strain_derivative
from tests.helpers import toy
from tests.helpers.samples import zbl_training_samples
from tests.helpers.toolkit import toy_batch
from tests.helpers.training import CONFIG, batch_of, fitted_params


def test_one_structure_batch_is_padded(dataset, fitted):
    batch = batch_of(dataset, fitted, [0])
    # the padding structure has no labels, so the loss only sees the real one
    assert batch.n_structures == 2
    assert torch.isnan(batch.energy[1]) and not torch.isnan(batch.energy[0])
    params = fitted_params(fitted)
    loss_fn = petfunc.make_loss(petfunc.PET(CONFIG))
    loss_padded, _ = loss_fn(params, batch)
    unpadded = make_batch([dataset.samples[0]], CONFIG, *fitted, dtype=torch.float64, pad=False)
    loss_alone, _ = loss_fn(params, unpadded)
    assert abs(loss_padded.item() - loss_alone.item()) <= 1e-10 * loss_alone.item()


def test_loss_skips_nan_labels_and_supports_loss_types(dataset, fitted):
    params = fitted_params(fitted)
    model = petfunc.PET(CONFIG)
    batch = batch_of(dataset, fitted, [0, 1, 2])
    forces = batch.forces.clone()
    forces[:3] = float("nan")
    with_nan = batch._replace(forces=forces)
    for kind in ("mse", "mae", "huber"):
        weights = petfunc.LossWeights.make(type=kind)
        loss, metrics = petfunc.make_loss(model, weights)(params, with_nan)
        assert torch.isfinite(loss)
        assert metrics["forces_count"].item() == forces[3:].numel()
        grads, _ = petfunc.make_grad_step(model, weights)(params, with_nan)
        assert all(torch.isfinite(g).all() for g in petfunc.tree.flatten(grads).values())
    # mse over the valid entries only, by hand
    _, f, _ = petfunc.energy_forces_strain_derivative(model.raw_energy)(
        params, batch.positions, batch.cell, batch.neighbors
    )
    _, metrics = petfunc.make_loss(model)(params, with_nan)
    expected = (f[3:] - forces[3:]).pow(2).mean()
    assert math.isclose(metrics["forces_loss"].item(), expected.item(), rel_tol=1e-12)


def test_loss_types_equal_torch_losses(dataset, fitted):
    """mse, mae and huber (any delta), with reduction mean or sum, equal torch.nn's
    losses on the labelled entries, which metatrain uses."""
    params = fitted_params(fitted)
    model = petfunc.PET(CONFIG)
    batch = batch_of(dataset, fitted, [0, 1, 2])
    _, f, _ = petfunc.energy_forces_strain_derivative(model.raw_energy)(
        params, batch.positions, batch.cell, batch.neighbors
    )
    forces = batch.forces.clone()
    forces[:2] = float("nan")  # metatrain drops NaN labels, then applies the torch loss
    batch = batch._replace(forces=forces)
    for reduction in ("mean", "sum"):
        cases = [
            ("mse", 1.0, torch.nn.MSELoss(reduction=reduction)),
            ("mae", 1.0, torch.nn.L1Loss(reduction=reduction)),
        ]
        cases += [("huber", d, torch.nn.HuberLoss(delta=d, reduction=reduction)) for d in (0.01, 0.1, 1.0)]
        for kind, delta, reference in cases:
            term = petfunc.LossTerm(1.0, kind, delta, reduction)
            weights = petfunc.LossWeights(petfunc.LossTerm(0.0), term, petfunc.LossTerm(0.0))
            loss, metrics = petfunc.make_loss(model, weights)(params, batch)
            expected = reference(f[2:], forces[2:]).item()
            assert math.isclose(metrics["forces_loss"].item(), expected, rel_tol=1e-12), (
                kind,
                delta,
                reduction,
            )
            assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        petfunc.LossTerm(1.0, "mse", 1.0, "none")


def test_energy_only_loss_does_not_differentiate_positions(dataset, fitted):
    params = fitted_params(fitted)
    batch = batch_of(dataset, fitted, [0, 1])
    weights = petfunc.LossWeights.make(forces=0.0, stress=0.0)
    loss, metrics = petfunc.make_loss(petfunc.PET(CONFIG), weights)(params, batch)
    assert "forces_loss" not in metrics and "stress_loss" not in metrics
    raw = petfunc.PET(CONFIG).raw_energy(params, batch.positions, batch.cell, batch.neighbors)
    n = torch.tensor([4.0, 8.0], dtype=torch.float64)
    assert math.isclose(loss.item(), ((raw - batch.energy) / n).pow(2).mean().item(), rel_tol=1e-12)


# -----------------------------------------------------------------------------------
# ZBL: the repulsion is an additive model, removed from the labels


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


def test_training_targets_exclude_zbl():
    """Labels made by the model itself (eval mode, ZBL included) are fitted exactly
    by its training-mode output: the loss is 0 only if ZBL's energy, forces and
    strain derivative are all removed from the targets."""
    config = petfunc.PETConfig(atomic_types=(13, 29), zbl=True, **SMALL)
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=torch.float64)
    params["composition_weights"] = torch.tensor([-3.0, -4.0], dtype=torch.float64)
    params["energy_scale"] = torch.tensor(0.3, dtype=torch.float64)
    samples = zbl_training_samples(config)
    for s in samples:
        pos, cell, nb = petfunc.structures.collate([s.structure], config, dtype=torch.float64)
        e, f, w = energy_forces_strain_derivative(model.energy)(params, pos, cell, nb)
        s.energy, s.forces = float(e[0]), f.numpy()
        s.virial = -w[0].numpy()
        assert abs(zbl_baseline(s, config)[0]) > 0.1  # the repulsion matters here
    batch = make_batch(samples, config, [-3.0, -4.0], 0.3, dtype=torch.float64)
    weights = petfunc.LossWeights.make(1.0, 1.0, 1.0)
    loss, metrics = petfunc.make_loss(model, weights)(params, batch)
    assert loss.item() < 1e-20, metrics
    for term in ("energy", "forces", "stress"):
        assert metrics[f"{term}_count"].item() > 0


def test_loss_weights_take_numbers_and_mappings_as_terms():
    """``LossWeights(energy=1.0, forces=10.0)`` is the structured form with mse terms,
    and its loss is the hand-weighted sum of the terms."""
    weights = petfunc.LossWeights(energy=1.0, forces=10.0, stress=0)
    structured = petfunc.LossWeights(
        energy=petfunc.LossTerm(1.0), forces=petfunc.LossTerm(10.0), stress=petfunc.LossTerm(0.0)
    )
    assert weights == structured
    assert petfunc.LossWeights(forces={"weight": 2.0, "type": "huber"}).forces == petfunc.LossTerm(
        2.0, "huber"
    )
    assert petfunc.LossWeights(energy=torch.tensor(3.0)).energy == petfunc.LossTerm(3.0)
    batch = toy_batch(3)
    params = toy.init()
    loss, metrics = petfunc.make_loss(toy.energy, weights)(params, batch)
    assert torch.allclose(loss, metrics["energy_loss"] + 10.0 * metrics["forces_loss"], rtol=1e-14)


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("forces", "10", r"forces must be a weight \(a number\), a LossTerm or a mapping.*'10'"),
        ("energy", True, r"energy must be a weight"),
        ("stress", {"weigth": 1.0}, r"stress has unknown keys \['weigth'\]"),
        ("per_atom", "yes", r"per_atom must be True or False"),
    ],
)
def test_loss_weights_refuse_bad_values_when_made(field, value, message):
    with pytest.raises(TypeError, match=message):
        petfunc.LossWeights(**{field: value})
    with pytest.raises(ValueError, match=r"loss weight must be >= 0"):
        petfunc.LossWeights(forces=-1.0)
