"""The numbers of a run: the validation loss of the whole set, whatever the batching."""

import pytest
import torch

from petfunc.model import PET
from petfunc.trainer.metrics import Sums, floats
from tests.helpers.trainer import TINY_MODEL


def test_validation_loss_does_not_depend_on_batching(dataset):
    """The validation loss is that of the whole validation set as one batch, so
    ``best_model_metric: loss`` picks the same epoch with any batch size or number
    of processes (the mean of the batch losses did not)."""
    import ase.io

    from petfunc import PETConfig
    from petfunc.data.samples import fit_composition, fit_scale, make_batch, sample_from_atoms
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
