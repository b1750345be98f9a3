"""The numbers of a training run: per-epoch sums of the step metrics, the best-model
metric, the checks that stop a diverged run, and the lines and rows that report
them (the log, ``metrics.csv``)."""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping, Sequence

import torch

from petfunc import tree
from petfunc.train import LossWeights


TERMS = ("energy", "forces", "stress")  # the loss terms, in the order of every report


class TrainingError(RuntimeError):
    """Training cannot continue (a non-finite loss or parameters)."""


class Sums:
    """Epoch sums of the per-batch metrics: ``loss`` (sum of batch losses),
    ``batch_count`` and ``{term}_sse``/``_sae``/``_count`` for the active ``terms``.

    The keys are fixed by ``terms``, so every rank holds the same keys even when it
    evaluated no batch, and every value is a sum: the ``reduce_metrics`` hook
    all-reduces them with SUM and :meth:`summary` gives the global means.

    With ``weights`` (validation) the summary's ``loss`` is the loss of all the
    structures seen as one batch (from the per-term sums ``{term}_lsum`` of the
    elementwise losses), which does not depend on how they were batched or on the
    number of processes; without, it is the mean of the batch losses (training,
    where each step's loss is that of its whole global batch).
    """

    def __init__(self, terms: Sequence[str], weights: LossWeights | None = None):
        self.terms = tuple(terms)
        self.weights = weights
        self.values: dict[str, float] = {"loss": 0.0, "batch_count": 0.0}
        for term in self.terms:
            for kind in ("sse", "sae", "count") + (("lsum",) if weights is not None else ()):
                self.values[f"{term}_{kind}"] = 0.0

    def add(self, metrics: dict[str, float]):
        """Add one batch's metrics (floats, see :func:`floats`)."""
        self.values["batch_count"] += 1.0
        for key in self.values:
            if key in metrics:
                self.values[key] += metrics[key]
        if self.weights is not None:
            for term in self.terms:
                loss = metrics[f"{term}_loss"]
                if getattr(self.weights, term).reduction == "mean":
                    loss = loss * metrics[f"{term}_count"]
                self.values[f"{term}_lsum"] += loss

    def _pooled_loss(self) -> float:
        loss = 0.0
        for term in self.terms:
            spec = getattr(self.weights, term)
            total, count = self.values[f"{term}_lsum"], self.values[f"{term}_count"]
            if spec.reduction == "mean":
                total = total / count if count > 0 else 0.0
            loss += spec.weight * total
        return loss

    def summary(self, scale: float) -> dict[str, float]:
        """``loss`` and the ``{term}_rmse``/``_mae`` of the sums, in eV units
        (``scale``: the energy scale the batches were divided by)."""
        batches = self.values["batch_count"]
        if batches <= 0:
            loss = math.nan
        elif self.weights is not None:
            loss = self._pooled_loss()
        else:
            loss = self.values["loss"] / batches
        out = {"loss": loss}
        for term in self.terms:
            count = self.values[f"{term}_count"]
            if count > 0:
                out[f"{term}_rmse"] = math.sqrt(self.values[f"{term}_sse"] / count) * scale
                out[f"{term}_mae"] = self.values[f"{term}_sae"] / count * scale
            else:
                out[f"{term}_rmse"] = math.nan
                out[f"{term}_mae"] = math.nan
        return out


def floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """A step's metrics (scalar tensors) as floats, with one device synchronisation."""
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return dict(zip(keys, values))


def selected_metric(summary: Mapping[str, float], name: str, terms: Sequence[str]) -> float:
    """metatrain's best-model metrics: ``loss``, or the product of the MAEs (RMSEs) of
    the active terms (energy per atom, forces, stress), skipping unlabelled ones."""
    if name == "loss":
        return summary["loss"]
    kind = "mae" if name == "mae_prod" else "rmse"
    value = 1.0
    for term in terms:
        x = summary.get(f"{term}_{kind}", math.nan)
        if not math.isnan(x):
            value *= x
    return value


def all_finite(params) -> bool:
    """Whether every tensor of the parameter tree ``params`` is finite."""
    return all(bool(torch.isfinite(t).all()) for t in tree.flatten(params).values())


def check_loss(value: float, epoch: int, step: int) -> None:
    """Raise :class:`TrainingError` for a non-finite training loss ``value`` of the
    0-based ``epoch`` and ``step``."""
    if not math.isfinite(value):
        raise TrainingError(
            f"the training loss is {value} at epoch {epoch + 1}, step {step + 1}"
            + (" (the checkpoints of the epochs before are intact)" if epoch else "")
            + ". Lower the learning rate, check the labels for outliers, "
            "or train in float64 (base_precision: 64)."
        )


def epoch_line(row: Mapping, num_epochs: int, terms: Sequence[str], improved: bool) -> str:
    """The log line of an epoch's ``row`` (``*``: a new best epoch)."""
    parts = [f"epoch {row['epoch']:>4d}/{num_epochs}"]
    for prefix in ("train", "val"):
        if f"{prefix}_loss" not in row:
            continue
        text = f"{prefix} loss {row[f'{prefix}_loss']:.4g}"
        for term in terms:
            value = row.get(f"{prefix}_{term}_rmse")
            if value is not None and not math.isnan(value):
                text += f" {term[0].upper()} {value:.3g}"
        parts.append(text)
    parts.append(f"lr {row['learning_rate']:.3g}")
    parts.append(f"{row['time_s']:.1f} s" + (" *" if improved else ""))
    return " | ".join(parts)


def errors_line(errors: Mapping[str, float]) -> str:
    """RMSE/MAE of :func:`petfunc.trainer.error_metrics` ``errors``, with units."""
    units = {
        "energy_per_atom": ("energy/atom", "eV/atom"),
        "forces": ("forces", "eV/Å"),
        "stress": ("stress", "eV/Å³"),
    }
    return ", ".join(
        f"{name} {errors[k + '_rmse']:.4g}/{errors[k + '_mae']:.4g} {unit}"
        for k, (name, unit) in units.items()
        if k + "_rmse" in errors
    )


def csv_text(history: Sequence[Mapping]) -> str:
    """``metrics.csv``: one row per epoch of ``history``, the columns in order of
    appearance, floats to 8 significant digits."""
    columns = list(history[0])
    for row in history[1:]:
        columns += [c for c in row if c not in columns]
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in history:
        writer.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in row.items()})
    return text.getvalue()
