"""metatrain's ``wandb:`` section: the epoch metrics of ``petfunc train`` logged to
Weights & Biases when ``wandb`` is installed (``pip install petfunc[wandb]``),
else a warning that says so. The section holds the arguments of ``wandb.init``
(``project``, ``name``, ``mode``, ...)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping


def wandb_run(section, options: Mapping, rank: int = 0):
    """The Weights & Biases run of the ``wandb`` section (``wandb.init(**section,
    config=options)``), or ``None``: no section, a rank other than 0 (rank 0 alone
    logs), or ``wandb`` not installed (with a warning on stderr).

    Raises:
        ValueError: the section is not a mapping, or ``wandb.init`` refuses it.
    """
    if not section:
        return None
    if not isinstance(section, Mapping):
        raise ValueError(
            "option 'wandb' must be a mapping of wandb.init's arguments (project, name, ...), "
            f"got {section!r}"
        )
    if rank != 0:
        return None
    try:
        import wandb  # noqa: PLC0415 - optional: the wandb extra
    except ImportError:
        print(
            "petfunc: warning: option 'wandb': wandb is not installed (pip install wandb, or "
            "petfunc[wandb]): the run is not logged to Weights & Biases; its metrics are in metrics.csv",
            file=sys.stderr,
        )
        return None
    try:
        return wandb.init(**section, config=dict(options))
    except Exception as error:  # noqa: BLE001 - wandb's own errors (no login, no network) name the cause
        raise ValueError(
            f"option 'wandb': wandb.init failed: {error} (log in with `wandb login`, or set "
            "wandb.mode: offline)"
        ) from None


def wandb_metrics(row: Mapping) -> tuple[int, dict[str, float]]:
    """``(epoch, metrics)`` of a row of ``metrics.csv``, named as metatrain groups
    them (``train_loss`` -> ``training/loss``, ``val_forces_rmse`` ->
    ``validation/forces_rmse``)."""
    metrics = {}
    for key, value in row.items():
        if key == "epoch":
            continue
        for prefix, group in (("train_", "training/"), ("val_", "validation/")):
            if key.startswith(prefix):
                key = group + key[len(prefix) :]
                break
        metrics[key] = float(value)
    return int(row["epoch"]), metrics


def epoch_logger(run) -> Callable[[Mapping], None]:
    """The ``on_epoch`` hook of :func:`petfunc.trainer.fit` that logs each epoch's
    metrics to the Weights & Biases ``run``, at the step of its epoch."""

    def log(row: Mapping) -> None:
        epoch, metrics = wandb_metrics(row)
        run.log(metrics, step=epoch, commit=True)

    return log
