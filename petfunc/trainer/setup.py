"""The phases that prepare a run, each a function of the ones before it that returns
a value (see :func:`petfunc.trainer.fit`)::

    run = setup.run(options, output_dir, restart=..., processes=...)  # options, dtype, device, seeds
    data = setup.data(run)                 # files, splits, label keys, loss terms
    model = setup.model(run, data)         # config, parameters, samples, baselines, LoRA
    steps = setup.steps(run, data, model)  # batches, optimizer, schedule, step functions
    folder = setup.folder(run, data, model)  # the output folder (rank 0)
"""

from __future__ import annotations

import dataclasses
import json
import random
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch

from petfunc import lora
from petfunc.config import PETConfig
from petfunc.data import Sample
from petfunc.devices import resolve_device
from petfunc.io import read_checkpoint
from petfunc.train import LossWeights, TrainState, make_optimizer, pack_state, trainable, warmup_cosine
from petfunc.trainer.baselines import composition_and_scale
from petfunc.trainer.batches import Batches, check_batches
from petfunc.trainer.checkpoints import Folder, Progress, prepare_folder
from petfunc.trainer.datasets import TrainingFiles, read_training_files
from petfunc.trainer.labels import unit_notes
from petfunc.trainer.metrics import TERMS
from petfunc.trainer.models import initial_model, restarted_model, with_adapters
from petfunc.trainer.options import absolute_paths, parse_loss, resolve_options, trained_parameters
from petfunc.trainer.processes import Processes
from petfunc.trainer.restart import check_restart, log_changed_options, restored, schedule_steps
from petfunc.trainer.steps import TrainStep, Validate, training_step, validation_loss


class Run(NamedTuple):
    """What every phase of a run reads.

    Attributes:
        options: the resolved options, with absolute paths.
        output_dir: where the files go (``None``: nothing is written).
        restart: the restart checkpoint's path (``None``: a new run).
        checkpoint: the restart checkpoint, read (:func:`petfunc.io.read_checkpoint`).
        dtype, device: of the parameters and batches.
        seed: the seed all randomness derives from (with the epoch).
        deterministic: whether the run uses deterministic algorithms.
        processes: how the run is shared by processes.
        log: where progress lines go.
        progress: show a progress bar (``None``: only on a terminal).
    """

    options: dict
    output_dir: Path | None
    restart: Any
    checkpoint: dict | None
    dtype: torch.dtype
    device: torch.device
    seed: int
    deterministic: bool
    processes: Processes
    log: Callable[[str], None]
    progress: bool | None


class Data(NamedTuple):
    """The run's dataset files and what their labels make of the loss.

    Attributes:
        files: the structures read and split (:class:`~petfunc.trainer.datasets.TrainingFiles`).
        weights: the loss terms, without those no training file has labels for.
        terms: the trained terms (weight > 0), in the order of :data:`TERMS`.
        val_terms: the terms validation reports (and the best-model metric
            multiplies): the trained ones and every labelled one, as in metatrain.
    """

    files: TrainingFiles
    weights: LossWeights
    terms: list[str]
    val_terms: list[str]


class Samples(NamedTuple):
    """The training, validation and test samples of a run (their graphs are the model's)."""

    train: list[Sample]
    val: list[Sample]
    test: list[Sample]


class Model(NamedTuple):
    """The model a run trains and the data in its terms.

    Attributes:
        config: the architecture.
        params: the initial parameters on the run's device, with the composition and
            scale (and the LoRA adapters, if any).
        energy_model: the :class:`~petfunc.PET` (or :class:`~petfunc.lora.LoRAPET`) trained.
        composition: the composition weights ``[num_species]`` (eV, float64).
        scale: the energy scale (eV).
        lora: the LoRA settings (``rank``, ``alpha``, ``targets``), or ``None``.
        samples: the training, validation and test samples, with the model's graphs.
    """

    config: PETConfig
    params: dict
    energy_model: Any
    composition: np.ndarray
    scale: float
    lora: dict | None
    samples: Samples

    def plain(self, params):
        """``params`` as a plain PET's (LoRA adapters merged into their layers)."""
        return lora.merge(params, self.energy_model.scaling) if self.lora is not None else params


class Steps(NamedTuple):
    """How the run steps: its batches, optimizer state, schedule and step functions.

    Attributes:
        batches: this process's training and validation batches.
        steps_per_epoch: training steps per epoch (of this process).
        start_epoch, num_epochs: the epochs to train, ``range(start_epoch, num_epochs)``.
        schedule: the learning rate of a step.
        state: the initial training state (a restart's restored), packed.
        progress: where the run stands (a restart's restored); the loop updates it.
        step: ``(state, batch) -> (state, metrics)``.
        validate: ``(params, batch) -> metrics``.
        reduce: ``{name: float sum} -> {name: float sum}`` across processes.
        train: the trained parameter paths (``None``: every parameter).
    """

    batches: Batches
    steps_per_epoch: int
    start_epoch: int
    num_epochs: int
    schedule: Callable[[int], Any]
    state: TrainState
    progress: Progress
    step: TrainStep
    validate: Validate
    reduce: Callable[[dict], dict]
    train: tuple[str, ...] | None


def run(
    options: Mapping | None,
    output_dir=None,
    *,
    restart=None,
    progress: bool | None = None,
    log: Callable[[str], None] = print,
    processes: Processes | None = None,
) -> Run:
    """The :class:`Run` of ``options`` (resolved here; ``None``: the restart
    checkpoint's), checked against the ``restart`` checkpoint if any (whose folder is
    the default ``output_dir``). Seeds the global RNGs of torch, numpy and ``random``
    with ``seed``, as metatrain does (petfunc itself uses private generators only).
    ``processes``: how the run is shared (default: one process)."""
    processes = processes or Processes()
    ckpt = None
    if restart is not None:
        ckpt = read_checkpoint(restart)
        if output_dir is None:
            output_dir = Path(restart).resolve().parent
        if options is None:
            options = json.loads(ckpt["options"])
    if options is None:
        raise ValueError("fit() needs options (or a restart checkpoint that holds them)")
    options = absolute_paths(resolve_options(options))
    training = options["architecture"]["training"]
    if training["distributed"] and processes.world_size <= 1:
        raise ValueError(
            "option 'architecture.training.distributed' is true, but this is one process: petfunc "
            "trains on several when started by torchrun (torchrun --nproc-per-node N -m petfunc train "
            "...; see the README's Multi-process section)"
        )
    if ckpt is not None:
        check_restart(options, ckpt, restart, log)
    device = resolve_device(options["device"], "option 'device'")
    # the run records the device it took (``auto`` and ``gpu`` name another on another machine)
    options["device"] = str(device)
    # fixed-order scatter-adds, so that the same seed gives the same run
    # (petfunc.determinism); by default on CPU only, where they cost nothing
    deterministic = training["deterministic"]
    if deterministic is None:
        deterministic = device.type == "cpu"
    dtype = torch.float64 if options["base_precision"] == 64 else torch.float32
    seed = options["seed"]
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)
    return Run(
        options, output_dir, restart, ckpt, dtype, device, seed, deterministic, processes, log, progress
    )


def data(run: Run) -> Data:
    """The :class:`Data` of ``run``: its files read and split (a restart's split kept),
    the loss of its options without the terms no file has labels for. Says which
    options changed since a restart's checkpoint, and where units make the model
    differ from metatrain's."""
    training = run.options["architecture"]["training"]
    weights, explicit = parse_loss(training["loss"])
    # metatrain's per_structure_targets: energy (and strain derivative) per structure
    weights = dataclasses.replace(weights, per_atom="energy" not in training["per_structure_targets"])
    files = read_training_files(run.options, weights, explicit, run.seed, run.checkpoint, run.log)
    if run.checkpoint is not None:  # after the data: options asking for another split are an error there
        log_changed_options(run.options, run.checkpoint, run.log)
    unit_notes(run.options, run.log)
    weights = files.weights
    terms = [t for t in TERMS if getattr(weights, t).weight > 0]
    labelled = (
        {"energy"}
        | {"forces" for lab in files.train_labels if lab.forces}
        | {"stress" for lab in files.train_labels if lab.stress or lab.virial}
    )
    return Data(files, weights, terms, [t for t in TERMS if t in terms or t in labelled])


def model(run: Run, data: Data) -> Model:
    """The :class:`Model` of ``run``: the restart checkpoint's, the fine-tuning
    checkpoint's or a fresh one; its samples; its composition weights and energy
    scale (stored in the parameters); LoRA adapters for ``finetune: {method: lora}``."""
    options, ckpt, log = run.options, run.checkpoint, run.log
    training = options["architecture"]["training"]
    model_hypers = dict(options["architecture"]["model"])
    if ckpt is not None:
        config, params = restarted_model(ckpt, run.restart, model_hypers, run.dtype, run.device)
    else:
        atomic_types = data.files.atomic_types
        config, params = initial_model(
            options, model_hypers, atomic_types, run.dtype, run.device, run.seed, log
        )
    train, val = data.files.samples(config)
    test = data.files.test_samples(config)
    if ckpt is None and not training["finetune"].get("read_from") and data.files.validation_only_types:
        log(
            f"warning: atomic type(s) {data.files.validation_only_types} appear in the validation set only: "
            "the model never trains on them (their composition weight is fitted to 0)"
        )
    composition, scale = composition_and_scale(
        options,
        ckpt,
        config,
        params,
        train,
        data.files.train_sizes,
        data.weights.per_atom,
        run.dtype,
        run.device,
        log,
    )
    if ckpt is None:  # a restart's parameters hold them already
        params["composition_weights"] = torch.as_tensor(composition, dtype=torch.float64, device=run.device)
        params["energy_scale"] = torch.tensor(scale, dtype=torch.float64, device=run.device)
    energy_model, params, lora_config = with_adapters(training["finetune"], config, params, run.seed, log)
    return Model(config, params, energy_model, composition, scale, lora_config, Samples(train, val, test))


def description(run: Run, data: Data, model: Model) -> dict:
    """What must be the same on every process of a run (each reads its own options
    and data): the options but the device (``cuda:LOCAL_RANK`` differs), and what
    each read; see :func:`petfunc.distributed.check_same_run`."""
    ckpt, samples = run.checkpoint, model.samples
    return {
        **{k: v for k, v in run.options.items() if k != "device"},
        "data": {
            "restart": None if ckpt is None else [int(ckpt["epoch"]), int(ckpt["step"])],
            "structures": [len(samples.train), len(samples.val), len(samples.test)],
            "atoms": int(sum(len(s) for s in samples.train)),
            # to 10 digits: nodes with other CPUs may round the fit differently
            "composition": [float(f"{w:.10g}") for w in model.composition],
            "energy_scale": float(f"{model.scale:.10g}"),
            "split": data.files.split,
        },
    }


def steps(run: Run, data: Data, model: Model) -> Steps:
    """The :class:`Steps` of ``run``: its batches (every batch from one training file,
    as in metatrain), the schedule (warm-up and cosine decay over the run's steps),
    the optimizer state (a restart's restored), and the step functions for its
    processes."""
    training = run.options["architecture"]["training"]
    processes = run.processes
    batches = _batches(run, data, model)
    steps_per_epoch = check_batches(batches, run.log)
    num_epochs = training["num_epochs"]
    total_steps = schedule_steps(
        run.checkpoint, num_epochs, steps_per_epoch, training["batch_size"], processes.world_size, run.log
    )
    schedule = warmup_cosine(training["learning_rate"], total_steps, training["warmup_fraction"])
    optimizer = make_optimizer(schedule, training["weight_decay"])
    # finetune methods 'heads' and 'lora': only these parameter paths train, the rest
    # stay as read
    train = trained_parameters(training["finetune"])
    opt_state, start_epoch, progress = restored(
        run.checkpoint, optimizer.init(trainable(model.params, train)), run.device
    )
    # parameters and moments in one buffer each: whole-vector optimizer steps
    state = pack_state(TrainState(model.params, opt_state), train)
    # the trace cache key (petfunc.compile) must name everything the traced step bakes
    # in: every option, the architecture, the loss weights and the schedule length
    # (which depends on the data). Any change traces afresh; an identical restart
    # loads the trace.
    trace_key = repr(
        (
            json.dumps(run.options, sort_keys=True, default=str),
            model.config,
            data.weights,
            total_steps,
            processes.split_step,
        )
    )
    compiling = {"compile": training["compile"], "backend": training["compile_backend"]}
    common = {**compiling, "rematerialise": training["remat"], "trace_key": trace_key, "log": run.log}
    validate = validation_loss(model.energy_model, data.weights, data.terms, data.val_terms, **common)
    step = training_step(
        model.energy_model,
        optimizer,
        data.weights,
        training["grad_clip_norm"],
        train,
        processes,
        first_step=progress.step,
        **common,
    )
    return Steps(
        batches,
        steps_per_epoch,
        start_epoch,
        num_epochs,
        schedule,
        state,
        progress,
        step,
        validate,
        processes.reduce_metrics,
        train,
    )


def _batches(run: Run, data: Data, model: Model) -> Batches:
    """This process's training and validation batches of ``run``."""
    training = run.options["architecture"]["training"]
    return Batches(
        model.samples.train,
        model.samples.val,
        model.config,
        model.composition,
        model.scale,
        training["batch_size"],
        run.seed,
        training["augmentation"],
        run.dtype,
        run.device,
        run.processes.rank,
        run.processes.world_size,
        data.files.train_sizes,
        data.files.val_sizes,
        training["max_atoms_per_batch"],
        training["min_atoms_per_batch"],
    )


def folder(run: Run, data: Data, model: Model) -> Folder | None:
    """The output folder of ``run`` (:func:`~petfunc.trainer.checkpoints.prepare_folder`),
    or ``None`` where nothing is written (no ``output_dir``, or a rank other than 0)."""
    if run.output_dir is None or not run.processes.is_main:
        return None
    return prepare_folder(
        run.output_dir,
        run.restart,
        run.checkpoint,
        run.log,
        interval=run.options["architecture"]["training"]["checkpoint_interval"],
        config=model.config,
        composition=model.composition,
        energy_scale=model.scale,
        dtype=run.dtype,
        seed=run.seed,
        options=run.options,
        split=data.files.split,
        world_size=run.processes.world_size,
    )
