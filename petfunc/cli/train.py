"""``petfunc train``: train a model from an options file (``docs/options.md``), a
restart checkpoint, or the built-in demo, into an output folder that a run which
stops before its first checkpoint leaves as it found it. Under torchrun every
process joins the process group and trains its share of each batch; rank 0 alone
writes files and logs."""

from __future__ import annotations

import argparse
import copy
import datetime
import os
import sys
from pathlib import Path

import yaml

from petfunc.cli.arguments import add_threads, positive_int
from petfunc.cli.demo import DEMO_STRUCTURES, make_default_dataset
from petfunc.cli.options import options_of
from petfunc.devices import resolve_device
from petfunc.distributed import (
    RunMismatchError,
    all_reduce_metrics,
    barrier,
    broadcast_object,
    init_from_env,
    shutdown,
)
from petfunc.trainer import TrainingError, fit
from petfunc.trainer.lock import LOCK_NAME, lock_output_folder
from petfunc.trainer.options import absolute_paths, resolve_options
from petfunc.trainer.runlog import LOG_NAME, console, say


DESCRIPTION = (
    "Train a PET model from an options file in metatrain's options.yaml layout "
    "(examples/options.yaml; every key and flag in docs/options.md). Flags and --set "
    "KEY=VALUE override the file. Without an options file: a demo of about a minute on a "
    "built-in EMT dataset. The output folder gets options.yaml (the complete options), "
    "last.ckpt, best.ckpt, epoch_N.ckpt, best_params.pt, metrics.csv and parity.png."
)


def add_parser(subparsers) -> None:
    """The ``train`` command and its flags."""
    parser = subparsers.add_parser("train", help="train a model", description=DESCRIPTION)
    parser.add_argument("options", nargs="?", help="options file (metatrain's options.yaml layout)")
    parser.add_argument(
        "-o",
        "--output",
        help="output folder (default: outputs/DATE/TIME; with --restart: the checkpoint's folder)",
    )
    parser.add_argument("--restart", metavar="CKPT", help="continue from last.ckpt/best.ckpt")
    parser.add_argument("--epochs", type=positive_int, help="architecture.training.num_epochs")
    parser.add_argument("--batch-size", type=positive_int, help="architecture.training.batch_size")
    parser.add_argument("--lr", type=float, help="architecture.training.learning_rate")
    parser.add_argument("--seed", type=int, help="seed")
    parser.add_argument("--dtype", choices=("float32", "float64"), help="base_precision 32 or 64")
    parser.add_argument("--device", help="cpu, cuda or cuda:N")
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
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="set any option, e.g. --set architecture.model.d_pet=64 (VALUE is YAML); repeatable",
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
    options, demo = options_of(args)
    # before any file is written: a device this process cannot use is named at once
    resolve_device(options.get("device") or "cpu", "--device" if args.device else "option 'device'")
    restart = args.restart
    rank, dist_kwargs = join_processes(options)
    if args.output:
        output = Path(args.output)
    elif restart is not None:
        output = Path(restart).resolve().parent
    else:
        now = datetime.datetime.now()
        output = Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")
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
                return train_into(args, options, output, demo, restart, rank, dist_kwargs)
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


def join_processes(options: dict) -> tuple[int, dict]:
    """``(rank, fit's keyword arguments)`` of this process. Under torchrun
    (``WORLD_SIZE`` > 1) it joins the process group (on CUDA ``options["device"]``
    becomes ``cuda:LOCAL_RANK``); only rank 0 logs."""
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


def train_into(args, options, output, demo, restart, rank, dist_kwargs) -> int:
    """The part of :func:`run` that writes into the output folder: the demo's dataset,
    ``options.yaml``, and the run."""
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
        with open(output / "options.yaml", "w", encoding="utf-8") as handle:
            yaml.safe_dump(resolved, handle, sort_keys=False)
        with console():
            say(f"output folder: {output}")
    kwargs = dict(restart=restart, progress=args.progress)
    kwargs.update(dist_kwargs)
    try:
        fit(resolved, output, **kwargs)
    except BaseException as error:
        # an error every rank raises at the same point leaves together, as a finished
        # run does (a rank tearing the group down first makes gloo abort another at
        # exit); others leave at once (both no-ops in one process)
        shutdown(wait_for_all=isinstance(error, RunMismatchError))
        raise
    shutdown()  # all ranks leave together
    return 0
