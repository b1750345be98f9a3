"""``petfunc train``: train a model from an options file (``docs/options.md``), a
restart checkpoint, or the built-in demo, into an output folder that a run which
stops before its first checkpoint leaves as it found it. Under torchrun every
process joins the process group and trains its share of each batch; rank 0 alone
writes files and logs."""

from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import yaml

from petfunc.cli.arguments import add_threads, positive_int
from petfunc.cli.demo import DEMO_STRUCTURES, make_default_dataset
from petfunc.cli.options import options_of
from petfunc.cli.outputs import default_run_folder, split_output
from petfunc.cli.tracking import epoch_logger, wandb_run
from petfunc.devices import resolve_device
from petfunc.distributed import (
    RunMismatchError,
    all_reduce_metrics,
    barrier,
    broadcast_object,
    in_slurm_job,
    init_from_env,
    shutdown,
    slurm_distributed,
    slurm_environment,
)
from petfunc.distributed.slurm import DEFAULT_PORT
from petfunc.export import export_model
from petfunc.trainer import TrainingError, fit
from petfunc.trainer.lock import LOCK_NAME, lock_output_folder
from petfunc.trainer.options import absolute_paths, resolve_options
from petfunc.trainer.runlog import LOG_NAME, console, say


DESCRIPTION = (
    "Train a PET model from an options file in metatrain's options.yaml layout "
    "(examples/options.yaml; every key and flag in docs/options.md). Flags and --set "
    "KEY=VALUE (or -r/--override) override the file. Without an options file: a demo of "
    "about a minute on a built-in EMT dataset. The output folder gets options.yaml (the "
    "complete options), last.ckpt, best.ckpt, epoch_N.ckpt, best_params.pt, metrics.csv, "
    "parity.png and train.log."
)


def add_parser(subparsers) -> None:
    """The ``train`` command and its flags."""
    parser = subparsers.add_parser("train", help="train a model", description=DESCRIPTION)
    parser.add_argument("options", nargs="?", help="options file (metatrain's options.yaml layout)")
    parser.add_argument(
        "-o",
        "--output",
        metavar="FILE_OR_DIR",
        help="a name ending in .pt2 or .pt: the file the best model is exported to at the end "
        "(as mtt train -o model.pt), the run folder being the default; any other: the run folder "
        "(default: outputs/DATE/TIME; with --restart: the checkpoint's folder)",
    )
    parser.add_argument(
        "--restart",
        metavar="CKPT",
        help="continue from last.ckpt/best.ckpt; auto: the newest outputs/DATE/TIME/last.ckpt",
    )
    parser.add_argument("--epochs", type=positive_int, help="architecture.training.num_epochs")
    parser.add_argument("--batch-size", type=positive_int, help="architecture.training.batch_size")
    parser.add_argument("--lr", type=float, help="architecture.training.learning_rate")
    parser.add_argument("--seed", type=int, help="seed")
    parser.add_argument("--dtype", choices=("float32", "float64"), help="base_precision 32 or 64")
    parser.add_argument("--device", help="auto (default: CUDA when visible), cpu, cuda (or gpu) or cuda:N")
    _add_step_flags(parser)
    parser.add_argument("--finetune", metavar="MODEL", help="architecture.training.finetune.read_from")
    parser.add_argument(
        "--finetune-method",
        choices=("full", "heads", "lora"),
        help="architecture.training.finetune.method (with metatrain's default config)",
    )
    parser.add_argument(
        "--structures",
        type=positive_int,
        default=DEMO_STRUCTURES,
        help=f"size of the built-in demo dataset (default {DEMO_STRUCTURES}; only without an options file)",
    )
    parser.add_argument(
        "-s",
        "--set",
        "-r",
        "--override",
        dest="set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any option, e.g. -r architecture.model.d_pet=64 (VALUE is YAML; -r/--override as in "
        "mtt train); repeatable",
    )
    parser.add_argument(
        "--no-progress", dest="progress", action="store_false", default=None, help="no progress bar"
    )
    add_threads(parser)


def _add_step_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of how the steps run: compilation, rematerialisation, determinism,
    augmentation."""
    compiling = parser.add_mutually_exclusive_group()
    compiling.add_argument(
        "--compile",
        action="store_true",
        default=None,
        help="trace and torch.compile the training and validation steps",
    )
    compiling.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="eager training steps (overrides compile: true of the options file)",
    )
    parser.add_argument(
        "--backend", choices=("inductor", "aot_eager", "eager"), help="architecture.training.compile_backend"
    )
    parser.add_argument(
        "--remat",
        action="store_true",
        default=None,
        help="recompute the transformer layers in the backward pass "
        "(less memory for energy-only losses; not with --compile)",
    )
    determinism = parser.add_mutually_exclusive_group()
    determinism.add_argument(
        "--deterministic",
        action="store_true",
        default=None,
        help="fixed-order scatter-adds: the same seed gives the same run (default on CPU only)",
    )
    determinism.add_argument(
        "--nondeterministic",
        dest="deterministic",
        action="store_false",
        help="let scatter-adds sum in any order (runs then differ by round-off)",
    )
    parser.add_argument(
        "--no-augmentation",
        dest="augmentation",
        action="store_false",
        default=None,
        help="no random rotations of training structures",
    )


def run(args: argparse.Namespace) -> int:
    """Run ``petfunc train`` with the parsed ``args``; returns the exit status."""
    output, model_file = split_output(args.output)
    options, demo = options_of(args)
    # handled here, not by the trainer: the run's Weights & Biases logger
    wandb_section = options.pop("wandb", None)
    # before any file is written: a device this process cannot use is named at once
    requested = options.get("device") or "auto"
    options["device"] = str(resolve_device(requested, "--device" if args.device else "option 'device'"))
    restart = args.restart
    rank, dist_kwargs = join_processes(options)
    if rank == 0 and str(requested).lower() in ("auto", "gpu"):
        with console():
            say(f"device {requested}: {describe_device(options['device'])}")
    if output is None:
        output = Path(restart).resolve().parent if restart is not None else default_run_folder()
    output = Path(broadcast_object(str(output)))  # rank 0's folder
    if output.exists() and not output.is_dir():
        raise ValueError(f"the output folder {str(output)!r} is a file")
    try:
        # rank 0 alone makes and writes the folder, locked before anything in it is
        # touched (a refusal leaves it alone); the lock removes the folders it made
        # when the run leaves them empty
        lock = lock_output_folder(output, rank == 0)
    except ValueError:
        shutdown()  # every rank raises the refusal here: they leave together
        raise
    try:
        with lock:
            before = FolderSnapshot(output, demo) if rank == 0 else None
            try:
                run = RunSetup(output, demo, restart, rank, dist_kwargs, model_file, wandb_section)
                return train_into(args, options, run)
            except TrainingError:
                raise  # training ran: its folder is the record of the run
            except BaseException:
                if before is not None and before.undo_if_untouched():
                    args.wrote_nothing = True
                raise
    finally:
        if getattr(args, "wrote_nothing", False) and not output.exists():
            print(
                f"petfunc: removed the output folder {output} (the run wrote no checkpoint to it)",
                file=sys.stderr,
            )


def describe_device(device: str) -> str:
    """The device a run takes, in words (``device: auto`` and ``gpu`` say which)."""
    if device.startswith("cuda"):
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    if torch.cuda.is_available():
        return device
    return f"{device} (no CUDA device is visible)"


def join_processes(options: dict) -> tuple[int, dict]:
    """``(rank, fit's keyword arguments)`` of this process. Under torchrun
    (``WORLD_SIZE`` > 1), or as a task of a SLURM job of several that ``srun``
    started (:mod:`petfunc.distributed.slurm`; metatrain's ``distributed`` and
    ``distributed_port`` options), it joins the process group (on CUDA
    ``options["device"]`` becomes ``cuda:LOCAL_RANK``); only rank 0 logs."""
    training = (options.get("architecture") or {}).get("training") or {}
    if "WORLD_SIZE" not in os.environ and in_slurm_job() and slurm_distributed(training.get("distributed")):
        os.environ.update(slurm_environment(distributed_port(training)))
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return 0, {}
    device = str(options.get("device") or "cpu")
    info = init_from_env(device="cuda" if device.startswith("cuda") else "cpu")
    if device.startswith("cuda"):
        options["device"] = str(info.device)  # cuda:LOCAL_RANK
    dist_kwargs = dict(rank=info.rank, world_size=info.world_size, reduce_metrics=all_reduce_metrics)
    if info.rank != 0:
        dist_kwargs.update(log=lambda message: None, progress=False)
    return info.rank, dist_kwargs


class FolderSnapshot:
    """What the output folder held before ``petfunc train`` began, so that a run that
    stops before its first checkpoint (bad data or options, Ctrl-C while the files
    are read or in the first epoch) leaves no trace: the ``options.yaml`` and
    ``train.log`` it wrote (and the demo's ``dataset.xyz``) are removed, those it
    replaced or appended to (a restart into its own folder) are restored; the
    folder's lock then removes the folders it made
    (:func:`petfunc.trainer.lock.lock_folder`).

    When anything else in the folder was written or changed (a checkpoint,
    ``metrics.csv``), everything is kept; so is the folder of a run that a NaN loss
    stopped (:class:`petfunc.trainer.TrainingError`): its ``options.yaml`` records
    the run that diverged.
    """

    def __init__(self, output: Path, demo: bool):
        self.output = output
        # the files the command itself writes before training starts
        self.own = ("options.yaml", LOG_NAME) + (("dataset.xyz",) if demo else ())
        self.entries = self._entries()
        self.previous = {}
        for name in self.own:
            if (output / name).is_file():
                self.previous[name] = (output / name).read_bytes()

    def _entries(self):
        if not self.output.is_dir():
            return {}
        return {
            p.name: (p.stat().st_mtime_ns, p.stat().st_size)
            for p in self.output.iterdir()
            if p.name != LOCK_NAME
        }

    def undo_if_untouched(self) -> bool:
        """Undo the command's own writes unless something else changed in the folder;
        returns whether it did."""
        now = self._entries()
        others = {name: state for name, state in now.items() if name not in self.own}
        if others != {name: state for name, state in self.entries.items() if name not in self.own}:
            return False  # training wrote something: keep the folder as it is
        for name in self.own:
            path = self.output / name
            try:
                if name in self.previous:
                    if path.read_bytes() != self.previous[name]:
                        path.write_bytes(self.previous[name])
                elif path.is_file():
                    path.unlink()
            except OSError:
                pass
        return True


def distributed_port(training: dict) -> int:
    """metatrain's ``architecture.training.distributed_port``: the rendezvous port of
    processes SLURM started (default 39591)."""
    port = training.get("distributed_port", DEFAULT_PORT)
    if isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535:
        raise ValueError(
            "option 'architecture.training.distributed_port' must be a port number (1 to 65535), "
            f"got {port!r}"
        )
    return port


@dataclass
class RunSetup:
    """Where and how :func:`train_into` runs: the run folder, whether it is the demo,
    the restart checkpoint, this process's rank and :func:`fit`'s keyword arguments,
    the exported model's file (``-o FILE``) and the ``wandb`` section."""

    output: Path
    demo: bool
    restart: str | None
    rank: int
    dist_kwargs: dict
    model_file: Path | None = None
    wandb_section: dict | None = None


def train_into(args, options, run: RunSetup) -> int:
    """The part of :func:`run` that writes into the output folder: the demo's dataset,
    ``options.yaml``, the run, and the exported model of ``-o FILE``."""
    output, demo, restart, rank, dist_kwargs = run.output, run.demo, run.restart, run.rank, run.dist_kwargs
    if demo:
        # check the options before spending time on the dataset
        probe = copy.deepcopy(options)
        probe["training_set"] = "dataset.xyz"
        resolve_options(probe)
        path = output / "dataset.xyz"
        if rank == 0:  # rank 0 writes, the others wait
            with console():
                say(
                    f"demo run: writing the built-in EMT dataset ({args.structures} Cu/Al/Ni structures) "
                    f"to {path}"
                )
            make_default_dataset(path, args.structures, seed=options.get("seed", 0) or 0)
        barrier()
        options["training_set"] = str(path.resolve())

    resolved = absolute_paths(resolve_options(options))
    if rank == 0:
        # with the wandb section, so that the file reruns the run as it was logged
        written = {**resolved, "wandb": run.wandb_section} if run.wandb_section else resolved
        with open(output / "options.yaml", "w", encoding="utf-8") as handle:
            yaml.safe_dump(written, handle, sort_keys=False)
        with console():
            say(f"output folder: {output}")
    kwargs = dict(restart=restart, progress=args.progress)
    kwargs.update(dist_kwargs)
    tracker = wandb_run(run.wandb_section, resolved, rank)
    if tracker is not None:
        kwargs["on_epoch"] = epoch_logger(tracker)
    try:
        result = fit(resolved, output, **kwargs)
    except BaseException as error:
        # an error every rank raises at the same point leaves together, as a finished
        # run does (a rank tearing the group down first makes gloo abort another at
        # exit); others leave at once (both no-ops in one process)
        shutdown(wait_for_all=isinstance(error, RunMismatchError))
        if tracker is not None:
            tracker.finish(exit_code=1)
        raise
    shutdown()  # all ranks leave together
    if tracker is not None:
        tracker.finish()
    if run.model_file is not None and rank == 0:
        write_model(result, resolved, run.model_file, output)
    return 0


def write_model(result, options: dict, path: Path, output: Path) -> None:
    """Export the best model of a finished run to ``path`` (``-o FILE``), in the run's
    dtype and for its device, and copy it into the run folder ``output`` (as
    ``mtt train`` does). A ``.pt2`` is the torch.export program (``petfunc export``
    also builds its AOTInductor library); a ``.pt`` a metatomic model."""
    dtype = torch.float64 if options["base_precision"] == 64 else torch.float32
    pt2 = {"device": torch.device(options["device"]), "aoti": False} if path.suffix == ".pt2" else {}
    try:
        written = export_model(result.config, result.params, path, dtype=dtype, **pt2)
    except (RuntimeError, ValueError, NotImplementedError) as error:
        raise ValueError(
            f"the run finished (its checkpoints are in {output}), but exporting the model to {str(path)!r} "
            f"failed: {error}; export it with: petfunc export {output / 'best.ckpt'} {path}"
        ) from error
    copy = output / written.name
    if copy.resolve() != written.resolve():
        shutil.copyfile(written, copy)
    with console():
        say(f"exported model: {written.resolve()} (a copy in {output})")
