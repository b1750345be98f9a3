"""The training loop of a run: the report of what it trains, then its epochs, each
training on the shuffled batches, validating (every epoch, as metatrain: the best
model does not depend on ``log_interval``), keeping the best parameters and writing
the epoch's files.

The loop is given everything as values (:mod:`petfunc.trainer.setup`): it calls the
step and validation functions on the batches it is given, and reduces the epoch's
sums with the function it is given; it does not know how many processes train.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable

from tqdm import tqdm

from petfunc import tree
from petfunc.train import TrainState, trainable
from petfunc.trainer.checkpoints import Folder, Progress
from petfunc.trainer.memory import reporting_out_of_memory, training_advice
from petfunc.trainer.metrics import Sums, TrainingError, all_finite, check_loss, epoch_line, selected_metric
from petfunc.trainer.setup import Data, Model, Run, Steps


def report(run: Run, data: Data, model: Model, steps: Steps) -> None:
    """Log what the run trains: its data, loss, baselines, model and epochs."""
    log, config, weights, samples = run.log, model.config, data.weights, model.samples
    training = run.options["architecture"]["training"]
    log(
        f"training set: {len(samples.train)} structures ({sum(len(s) for s in samples.train)} atoms), "
        f"validation set: {len(samples.val)} structures"
        + (f", test set: {len(samples.test)} structures" if samples.test else "")
        + f"; atomic types {list(config.atomic_types)}"
    )
    log(
        "loss terms: "
        + ", ".join(
            f"{t} ({getattr(weights, t).type}, weight {getattr(weights, t).weight:g})" for t in data.terms
        )
        + f"; energy scale {model.scale:.6g} eV; composition "
        + ", ".join(f"{z}: {w:.6g}" for z, w in zip(config.atomic_types, model.composition))
        + " eV"
    )
    dtype_name = str(run.dtype).replace("torch.", "")
    log(
        f"model: {tree.count(trainable(model.params, steps.train))} trainable parameters"
        + (f" (fine-tuning {', '.join(steps.train)} only)" if steps.train else "")
        + f" ({dtype_name}, {run.device}); seed {run.seed}; "
        + (
            f"{steps.steps_per_epoch} steps per epoch, epochs {steps.start_epoch + 1}..{steps.num_epochs}"
            if steps.start_epoch < steps.num_epochs
            else "no epoch left to train"
        )
        + (f", compile {training['compile_backend']}" if training["compile"] else "")
    )
    if weights.per_atom:
        log(
            "per epoch: loss (training units; training: mean over the steps, validation: of the whole set) "
            "and RMSE of E: energy per atom (eV/atom), F: forces (eV/Å), "
            "S: strain derivative per atom V·σ/N (eV/atom)"
        )
    else:
        log(
            "per epoch: loss (training units; training: mean over the steps, validation: of the whole set) "
            "and RMSE of E: energy per structure (eV), "
            "F: forces (eV/Å), S: strain derivative V·σ (eV) (per_structure_targets: [energy])"
        )


def train(
    run: Run,
    data: Data,
    model: Model,
    steps: Steps,
    folder: Folder | None,
    on_epoch: Callable[[dict], None] | None = None,
) -> TrainState:
    """Train the epochs ``steps.start_epoch .. steps.num_epochs - 1`` from
    ``steps.state``; returns the last state. ``steps.progress`` holds the steps
    taken, the best epoch, its parameters and the history; ``folder`` (if any) gets
    the epochs' files; ``on_epoch`` (if any) each epoch's row of metrics, on rank 0.

    Raises:
        TrainingError: the loss or the parameters became NaN/inf.
        OutOfMemory: a training step or the validation ran out of memory.
    """
    report(run, data, model, steps)
    training = run.options["architecture"]["training"]
    progress, state, val_batches = steps.progress, steps.state, None
    bar = tqdm(
        total=max(0, steps.num_epochs - steps.start_epoch) * steps.steps_per_epoch,
        disable=(not run.progress) if run.progress is not None else None,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        leave=False,
    )
    try:
        for epoch in range(steps.start_epoch, steps.num_epochs):
            t0 = time.perf_counter()
            state, summary = train_epoch(run, steps, data, model, state, epoch, bar)
            row = {
                "epoch": epoch + 1,
                "step": progress.step,
                "learning_rate": float(steps.schedule(max(progress.step - 1, 0))),
            }
            row.update({f"train_{k}": v for k, v in summary.items()})
            if model.samples.val:
                if val_batches is None:
                    val_batches = steps.batches.validation()
                summary = validate(run, steps, data, model, state.params, val_batches, epoch)
                if not math.isfinite(summary["loss"]):
                    raise TrainingError(
                        f"epoch {epoch + 1}: the validation loss is {summary['loss']}; "
                        "lower the learning rate or check the validation labels"
                    )
                row.update({f"val_{k}": v for k, v in summary.items()})
            metric = selected_metric(
                summary, training["best_model_metric"], data.val_terms if model.samples.val else data.terms
            )
            improved = record(progress, row, metric, state, epoch, t0)
            if folder is not None:
                folder.end_epoch(state, epoch + 1, progress, improved, steps.start_epoch, run.log)
            if on_epoch is not None and run.processes.is_main:
                on_epoch(dict(row))
            if (
                epoch == steps.start_epoch
                or (epoch + 1) % training["log_interval"] == 0
                or epoch + 1 == steps.num_epochs
            ):
                run.log(epoch_line(row, steps.num_epochs, data.val_terms, improved))
    finally:
        bar.close()
    return state


def train_epoch(run: Run, steps: Steps, data: Data, model: Model, state: TrainState, epoch: int, bar):
    """``(state, summary)`` after the training steps of ``epoch`` (0-based): the
    state, and the loss and errors of the epoch's batches summed over the processes
    (:class:`~petfunc.trainer.metrics.Sums`). ``bar`` shows the running errors.

    Raises:
        OutOfMemory: a step ran out of memory (the message names the batch).
    """
    energy_label = "E(eV/atom)" if data.weights.per_atom else "E(eV)"
    sums = Sums(data.terms)
    advice = training_advice(run.options)
    for index, (_, batch) in enumerate(steps.batches.training(epoch)):
        with reporting_out_of_memory(
            f"in the training step of epoch {epoch + 1}, batch {index + 1} of {steps.steps_per_epoch}",
            run.device,
            advice,
            batch,
        ):
            state, values = steps.step(state, batch)
        check_loss(values["loss"], epoch, steps.progress.step)
        steps.progress.step += 1
        sums.add(values)
        bar.update(1)
        running = sums.summary(model.scale)
        postfix = {"epoch": epoch + 1, "loss": f"{running['loss']:.4g}"}
        if "energy" in data.terms:
            postfix[energy_label] = f"{running['energy_rmse']:.3g}"
        if "forces" in data.terms:
            postfix["F(eV/Å)"] = f"{running['forces_rmse']:.3g}"
        bar.set_postfix(postfix, refresh=False)
    sums.values = steps.reduce(sums.values)
    summary = sums.summary(model.scale)
    if not all_finite(state.params):
        raise TrainingError(f"epoch {epoch + 1}: the parameters became NaN/inf")
    return state, summary


def validate(
    run: Run, steps: Steps, data: Data, model: Model, params, batches, epoch: int
) -> dict[str, float]:
    """The loss of the whole validation set and the errors of every labelled term,
    after ``epoch`` (0-based), summed over the processes (each evaluates its share of
    ``batches``; a process whose share is empty contributes zero sums).

    Raises:
        OutOfMemory: a batch ran out of memory (the message names it).
    """
    sums = Sums(data.val_terms, data.weights)
    advice = training_advice(run.options, step=False)
    for index, batch in enumerate(batches):
        with reporting_out_of_memory(
            f"in the validation after epoch {epoch + 1}, batch {index + 1} of {len(batches)}",
            run.device,
            advice,
            batch,
        ):
            sums.add(steps.validate(params, batch))
    sums.values = steps.reduce(sums.values)
    return sums.summary(model.scale)


def record(progress: Progress, row: dict, metric: float, state: TrainState, epoch: int, t0: float) -> bool:
    """Add the ``row`` of ``epoch`` (0-based, begun at ``time.perf_counter()`` ``t0``)
    with its best-model ``metric`` to ``progress``; keep the parameters of ``state``
    if the metric improved, and return whether it did."""
    row["selection_metric"] = metric  # this epoch's best_model_metric
    improved = metric < progress.best_metric
    if improved:
        progress.best_metric, progress.best_epoch = metric, epoch + 1
        progress.best_params = tree.tree_map(lambda t: t.detach().clone(), state.params)
    row["time_s"] = time.perf_counter() - t0
    progress.history.append(row)
    return improved
