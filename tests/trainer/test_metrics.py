"""The numbers of a run: the validation loss of the whole set, whatever the batching;
the best-model metric, the log line and metrics.csv."""

import math

import pytest
import torch

from petfunc.model import PET
from petfunc.trainer.metrics import (
    TERMS,
    Sums,
    TrainingError,
    all_finite,
    check_loss,
    csv_text,
    epoch_line,
    floats,
    selected_metric,
)
from tests.helpers.trainer import TINY_MODEL


def test_validation_loss_does_not_depend_on_batching(dataset):
    """The validation loss is that of the whole validation set as one batch, so
    ``best_model_metric: loss`` picks the same epoch with any batch size or number
    of processes (the mean of the batch losses did not)."""
    import ase.io

    from petfunc import PETConfig
    from petfunc.data import fit_composition, fit_scale, make_batch, sample_from_atoms
    from petfunc.train.loss import LossTerm, LossWeights, make_loss

    frames = ase.io.read(dataset, ":7")
    config = PETConfig(atomic_types=tuple(sorted({int(z) for a in frames for z in a.numbers})), **TINY_MODEL)
    samples = [sample_from_atoms(a, config) for a in frames]
    samples[2].forces = None  # unequal label counts per batch
    w = fit_composition(samples, config.num_species)
    c = fit_scale(samples, w)
    params = PET(config).init(seed=0, dtype=torch.float64)
    params["composition_weights"] = torch.tensor(w)
    params["energy_scale"] = torch.tensor(c)
    for weights in (
        LossWeights.make(1.0, 1.0, 0.5),
        LossWeights(LossTerm(1.0, "mae"), LossTerm(2.0, "huber", delta=0.1), LossTerm(0.5, reduction="sum")),
    ):
        loss_fn = make_loss(PET(config), weights)
        terms = [t for t in ("energy", "forces", "stress") if getattr(weights, t).weight > 0]

        def epoch_loss(size, pooled=True, terms=terms, weights=weights, loss_fn=loss_fn):
            sums = Sums(terms, weights if pooled else None)
            for start in range(0, len(samples), size):
                batch = make_batch(samples[start : start + size], config, w, c, torch.float64)
                sums.add(floats(loss_fn(params, batch)[1]))
            return sums.summary(c)["loss"]

        whole = float(loss_fn(params, make_batch(samples, config, w, c, torch.float64))[0])
        for size in (1, 2, 3, 7):
            assert epoch_loss(size) == pytest.approx(whole, rel=1e-12), (weights, size)
        assert abs(epoch_loss(2, pooled=False) / whole - 1) > 1e-3  # the mean of batch losses differs


def test_selected_metric_lines_and_csv():
    """metatrain's best-model metrics (products of the labelled terms' errors), the
    epoch's log line, and metrics.csv's columns in order of appearance."""
    summary = {"loss": 3.0, "energy_mae": 0.5, "forces_mae": 4.0, "stress_mae": math.nan, "energy_rmse": 2.0}
    assert selected_metric(summary, "loss", TERMS) == 3.0
    assert selected_metric(summary, "mae_prod", TERMS) == 2.0  # the unlabelled stress is skipped
    assert selected_metric(summary, "rmse_prod", TERMS) == 2.0
    row = {
        "epoch": 3,
        "step": 9,
        "learning_rate": 0.001,
        "train_loss": 1.5,
        "train_energy_rmse": 0.25,
        "val_loss": 2.0,
        "val_forces_rmse": math.nan,
        "time_s": 1.25,
    }
    assert epoch_line(row, 10, TERMS, True) == (
        "epoch    3/10 | train loss 1.5 E 0.25 | val loss 2 | lr 0.001 | 1.2 s *"
    )
    text = csv_text([{"epoch": 1, "loss": 0.123456789}, {"epoch": 2, "loss": 1.0, "time_s": 2.5}])
    assert text == "epoch,loss,time_s\n1,0.12345679,\n2,1,2.5\n"
    with pytest.raises(TrainingError, match=r"the training loss is nan at epoch 2, step 5 \(the checkpoints"):
        check_loss(math.nan, 1, 4)
    check_loss(1.0, 0, 0)
    assert all_finite({"a": torch.ones(2)}) and not all_finite({"a": torch.tensor([1.0, math.inf])})
