"""``fit(options)``: the training run of ``petfunc train`` as a library function.

:func:`fit` runs the phases of :mod:`petfunc.trainer.setup` and the loop of
:mod:`petfunc.trainer.loop`::

    run = setup.run(options, output_dir, restart=..., processes=...)  # options, dtype, device, seeds
    data = setup.data(run)                 # files, splits, label keys, loss terms
    model = setup.model(run, data)         # config, parameters, samples, baselines, LoRA
    processes.check_same_run(setup.description(run, data, model))
    steps = setup.steps(run, data, model)  # batches, optimizer, schedule, step functions
    folder = setup.folder(run, data, model)  # the output folder (rank 0)
    state = loop.train(run, data, model, steps, folder)
    return finish(run, data, model, steps, folder, state)

What a run does, in metatrain's recipe (``docs/training.md`` has the whole story):

1. it reads the training (validation, test) extxyz files with ASE, splits them as
   ``mtt train`` does and builds the neighbour lists once;
2. it fits the composition weights and the energy scale on the training set
   (metatrain's ``CompositionModel`` and ``Scaler``) and stores them in the
   parameters (``composition_weights``, ``energy_scale``, never trained);
3. it trains on shuffled batches (each file's last partial batch dropped; or
   packed by atom count with ``max_atoms_per_batch``), with random O(3)
   augmentation, Adam(W) with linear warm-up and cosine decay stepped per batch,
   and global gradient-norm clipping;
4. it validates every epoch with the same loss, keeps the best parameters by
   ``best_model_metric`` and writes ``last.ckpt``, ``best.ckpt``, ``metrics.csv``
   and, at the end, ``parity.png`` and ``best_params.pt``;
5. it evaluates the best parameters on the test set, if any.

Randomness: all of it (split, shuffling, augmentation, initial parameters) derives
from ``seed`` and the epoch, never from global RNG state or the rank, so a run
restarted from the checkpoint of epoch k continues bit for bit like the
uninterrupted run (same device, same dtype, same number of threads). On CPU the
training runs by default under :func:`petfunc.deterministic_algorithms`, so that
the parallel float sums of scatter-adds do not depend on thread timing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from petfunc import tree
from petfunc.config import PETConfig
from petfunc.determinism import deterministic_algorithms
from petfunc.io import save_params
from petfunc.train import TrainState
from petfunc.trainer import loop, setup
from petfunc.trainer.checkpoints import Folder
from petfunc.trainer.evaluation import error_metrics, parity_plot, predict
from petfunc.trainer.lock import lock_output_folder, this_command
from petfunc.trainer.metrics import errors_line
from petfunc.trainer.processes import processes as processes_of
from petfunc.trainer.runlog import LOG_NAME, RunLog, default_log, header, say


@dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        config: the model architecture.
        params: the best parameters (by ``best_model_metric``), CPU tensors.
        last_params: the parameters after the last epoch, CPU tensors.
        best_epoch: epoch (1-based) of ``params``; 0 if no epoch ran.
        best_metric: the validation metric at ``best_epoch``.
        history: one dict of metrics per epoch (the rows of ``metrics.csv``).
        output_dir: where the files were written (``None`` if nothing was written).
        files: name -> path of the written files.
        compiled_graphs: with ``compile: true``, how many graphs were compiled for
            the ``"train"`` and ``"eval"`` steps (1 each when no batch recompiled).
        test_errors: RMSE and MAE of ``params`` on the ``test_set`` (keys as
            :func:`error_metrics`; empty without a test set, and on ranks other than 0).
    """

    config: PETConfig
    params: Any
    last_params: Any
    best_epoch: int
    best_metric: float
    history: list[dict]
    output_dir: Path | None
    files: dict[str, Path] = field(default_factory=dict)
    compiled_graphs: dict[str, int] = field(default_factory=dict)
    test_errors: dict[str, float] = field(default_factory=dict)


def fit(
    options: Mapping | None,
    output_dir=None,
    *,
    restart=None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    reduce_grads: Callable | None = None,
    reduce_metrics: Callable | None = None,
    rank: int = 0,
    world_size: int = 1,
    on_epoch: Callable[[dict], None] | None = None,
) -> FitResult:
    """Train a PET model (see the module docstring).

    Args:
        options: a metatrain-style options mapping (:func:`petfunc.trainer.options.resolve_options`
            is applied; already resolved options are accepted too).
        output_dir: folder for checkpoints, ``metrics.csv`` and ``parity.png``
            (created). ``None``: the restart checkpoint's folder, else nothing is
            written.
        restart: a ``last.ckpt``/``best.ckpt`` to continue from: parameters, optimizer
            state, epoch, composition and scale are restored; the run then continues
            exactly as the uninterrupted one would. ``options`` still apply (e.g. more
            epochs; the learning-rate schedule then changes), the architecture is the
            checkpoint's.
        progress: show a tqdm bar (``None``: only on a terminal).
        log: the console: where the run's lines go (default: stdout, bar-safe). They
            go through the ``petfunc.trainer`` logger (:mod:`petfunc.trainer.runlog`)
            and, with an ``output_dir`` (rank 0), into ``output_dir/train.log`` too.
        reduce_grads: data-parallel hook ``grads -> grads`` applied between the
            gradient step and the optimizer step (e.g. an all-reduce average). When
            given, or when ``world_size > 1``, the step is split into ``grad_step`` +
            ``reduce_grads`` + ``apply_gradients``; otherwise one fused ``train_step``.
        reduce_metrics: hook ``{name: float sum} -> {name: float sum}`` for the summed
            epoch metrics (all-reduce SUM in data-parallel training).
        rank, world_size: this process's shard of every batch plan; only rank 0 writes.
            In a ``torch.distributed`` process group they must be the group's, and
            the processes check that they train the same run before the first step.
        on_epoch: called on rank 0 after each epoch with its metrics (the epoch's
            row of ``metrics.csv``: ``epoch``, ``step``, ``learning_rate``,
            ``train_*`` and ``val_*``), e.g. to log them elsewhere.

    Returns:
        a :class:`FitResult`.

    Raises:
        ValueError / FileNotFoundError: bad options or data (before training starts).
        FolderInUseError: another run writes into the output folder, locked for the
            run's life (:mod:`petfunc.trainer.lock`); a ``ValueError`` naming it.
        TrainingError: the loss or the parameters became NaN/inf, or (:class:`OutOfMemory`)
            a step, the validation or the test evaluation ran out of memory; the message
            names where, and what to change; checkpoints written before stay intact.
    """
    processes = processes_of(rank, world_size, reduce_grads, reduce_metrics)
    # every line goes through the petfunc loggers: to ``log`` and, from the folder's
    # preparation on, into its train.log (runlog)
    with RunLog(log or default_log) as run_log:
        run = setup.run(options, output_dir, restart=restart, progress=progress, log=say, processes=processes)
        # the folder is this run's alone from before its clean-up until its last
        # file; train.log is closed before the lock is released
        with (
            lock_output_folder(run.output_dir, processes.is_main, log=say),
            deterministic_algorithms(run.deterministic),
            contextlib.ExitStack() as log_file,
        ):
            data = setup.data(run)
            model = setup.model(run, data)
            # every process reads its own options and data: they must describe one run
            # (another learning rate would train a different model without a word,
            # another batch size abort in gloo, other epochs hang)
            processes.check_same_run(setup.description(run, data, model))
            steps = setup.steps(run, data, model)
            folder = setup.folder(run, data, model)
            if folder is not None:
                log_file.enter_context(run_log.writing(*log_file_of(run, data, folder)))
            else:
                run_log.without_file()
            state = loop.train(run, data, model, steps, folder, on_epoch=on_epoch)
            return finish(run, data, model, steps, folder, state)


def log_file_of(run: setup.Run, data: setup.Data, folder: Folder) -> tuple[Path, list[str], Any]:
    """``(path, header, restart)`` of the ``train.log`` of ``run`` (see
    :meth:`petfunc.trainer.runlog.RunLog.writing`)."""
    lines = header(
        folder=folder.output_dir,
        command=this_command(),
        device=run.device,
        dtype=run.dtype,
        world_size=run.processes.world_size,
        per_atom=data.weights.per_atom,
        restart=run.restart,
    )
    return folder.output_dir / LOG_NAME, lines, run.restart


def finish(
    run: setup.Run,
    data: setup.Data,
    model: setup.Model,
    steps: setup.Steps,
    folder: Folder | None,
    state: TrainState,
) -> FitResult:
    """The end of a run: the best parameters evaluated on the test set (rank 0), and
    into the folder ``best_params.pt``, the parity plots, the final ``metrics.csv``
    and, for a restart that trained nothing, its ``last.ckpt``; the :class:`FitResult`."""
    progress, samples, config, log = steps.progress, model.samples, model.config, run.log
    training = run.options["architecture"]["training"]
    if progress.best_params is None:
        progress.best_params = state.params
    best = model.plain(progress.best_params)
    best_cpu = tree.tree_map(lambda t: t.detach().to("cpu"), best)
    last_cpu = tree.tree_map(lambda t: t.detach().to("cpu"), model.plain(state.params))
    test_errors: dict[str, float] = {}
    if samples.test and run.processes.is_main:
        test_pred = predict(config, best, samples.test, batch_size=training["batch_size"])
        test_errors = error_metrics(test_pred)
        log(
            f"test set ({len(samples.test)} structures), best epoch {progress.best_epoch}, RMSE/MAE: "
            + errors_line(test_errors)
        )
    if folder is not None:
        with folder.advising():
            save_params(folder.files["params"], config, best_cpu)
        pred = predict(config, best, samples.val or samples.train, batch_size=training["batch_size"])
        what = "validation" if samples.val else "training"
        parity_plot(pred, folder.files["parity"], title=f"{what} set, best epoch {progress.best_epoch}")
        if samples.test:
            folder.files["parity_test"] = folder.output_dir / "parity_test.png"
            parity_plot(
                test_pred, folder.files["parity_test"], title=f"test set, best epoch {progress.best_epoch}"
            )
        log(
            f"best epoch {progress.best_epoch} ({training['best_model_metric']} {progress.best_metric:.4g}); "
            f"{what} set RMSE/MAE: " + errors_line(error_metrics(pred))
        )
        if (
            folder.restart_files is not None
        ):  # a restart at its last epoch: this run's last.ckpt, then the others
            folder.checkpoint(folder.files["last"], state, steps.start_epoch, progress)
            folder.settle_restart(progress.best_epoch, steps.start_epoch, log)
        folder.write_csv(progress.history)  # complete after a restart that trained nothing, too
        log(f"files of this run in {folder.output_dir}: " + ", ".join(folder.written()))
    graphs = {
        name: fn.num_graphs
        for name, fn in (("train", steps.step), ("eval", steps.validate))
        if hasattr(fn, "num_graphs")
    }
    return FitResult(
        config,
        best_cpu,
        last_cpu,
        progress.best_epoch,
        progress.best_metric,
        progress.history,
        None if folder is None else folder.output_dir,
        {} if folder is None else folder.files,
        graphs,
        test_errors,
    )
