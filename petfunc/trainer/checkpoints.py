"""The output folder of a run: its checkpoints, ``metrics.csv``, and a restart's
settling of the folder with the checkpoint it continues.

The checkpoint format is :mod:`petfunc.io.checkpoint`'s (its one writer and
reader); this module decides what is written where and when.
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petfunc._files import NoSpaceError, atomic_write, remove_leftover_temporaries
from petfunc._version import __version__
from petfunc.config import PETConfig
from petfunc.io import read_checkpoint, write_checkpoint
from petfunc.train import TrainState
from petfunc.trainer.lock import holds_lock
from petfunc.trainer.metrics import TrainingError, all_finite, csv_text


@dataclass
class Progress:
    """Where a run stands: what a checkpoint records besides the training state.

    Attributes:
        step: optimizer steps taken.
        best_epoch: the epoch (1-based) of the best validation metric so far; 0: none.
        best_metric: that metric (``inf``: none yet).
        best_params: the parameters of ``best_epoch`` (``None``: none yet).
        history: one dict of metrics per epoch (the rows of ``metrics.csv``).
    """

    step: int = 0
    best_epoch: int = 0
    best_metric: float = math.inf
    best_params: Any = None
    history: list[dict] = field(default_factory=list)


def epoch_files(output_dir: Path) -> dict[int, str]:
    """``{N: "epoch_N.ckpt"}`` of the numbered checkpoints in ``output_dir``."""
    found = {}
    for path in output_dir.glob("epoch_*.ckpt"):
        number = path.name[len("epoch_") : -len(".ckpt")]
        if number.isdigit():
            found[int(number)] = path.name
    return found


def _version() -> str:
    return __version__


class Folder:
    """The output folder of a run (on rank 0): the files it writes, and the writer of
    its checkpoints, which holds what does not change during the run (the model,
    the baselines, the options, the split).

    Attributes:
        output_dir: the folder.
        files: ``last``, ``best``, ``csv``, ``params``, ``parity`` (and ``parity_test``
            once written) -> path.
        written_epochs: the names of the ``epoch_N.ckpt`` files this run wrote.
        restart_files: the restart's :class:`RestartFiles` until they are settled.
        resume: ``(checkpoint, epoch)`` a run stopped now continues from: this run's
            newest ``last.ckpt``, else the restart checkpoint, else ``None``.
    """

    def __init__(self, output_dir: Path, interval: int, **fixed):
        self.output_dir = output_dir
        self.interval = interval  # checkpoint_interval: epoch_N.ckpt every that many epochs
        self.files = {
            "last": output_dir / "last.ckpt",
            "best": output_dir / "best.ckpt",
            "csv": output_dir / "metrics.csv",
            "params": output_dir / "best_params.pt",
            "parity": output_dir / "parity.png",
        }
        self.written_epochs: set[str] = set()
        self.restart_files: RestartFiles | None = None
        self.resume: tuple[Path, int] | None = None
        self._write = functools.partial(write_checkpoint, version=_version(), **fixed)

    def checkpoint(self, path: Path, state: TrainState, epoch: int, progress: Progress) -> None:
        """Write the checkpoint of ``state`` after ``epoch`` epochs to ``path``; refuses
        non-finite parameters."""
        if not all_finite(state.params):
            raise TrainingError(f"refusing to write {path.name}: the parameters are not finite")
        with self.advising():
            self._write(
                path,
                params=state.params,
                opt_state=state.opt_state,
                epoch=epoch,
                step=progress.step,
                best_epoch=progress.best_epoch,
                best_metric=progress.best_metric,
                best_params=progress.best_params,
                history=progress.history,
            )
        if path == self.files["last"]:
            self.resume = (path, epoch)

    @contextlib.contextmanager
    def advising(self):
        """Add to a :class:`petfunc.io.NoSpaceError` raised inside (a file of the run
        found no room) how to go on from there."""
        try:
            yield
        except NoSpaceError as error:
            if self.resume is None:
                advice = "the run has no checkpoint to continue from: start it again once there is room"
            else:
                advice = (
                    f"once there is room, continue the run with --restart {self.resume[0]} "
                    f"(epoch {self.resume[1]})"
                )
            raise NoSpaceError(error.errno, f"{error}; {advice}", error.filename) from error

    def end_epoch(
        self, state: TrainState, epoch: int, progress: Progress, improved: bool, start_epoch: int, log
    ) -> None:
        """The files of a finished ``epoch`` (1-based): ``last.ckpt``, ``best.ckpt`` if
        it ``improved``, then a restart's files (see :meth:`settle_restart`; the run
        started after ``start_epoch``), ``epoch_N.ckpt`` every ``checkpoint_interval``
        epochs, ``metrics.csv``."""
        self.checkpoint(self.files["last"], state, epoch, progress)
        if improved:
            self.checkpoint(self.files["best"], state, epoch, progress)
        self.settle_restart(progress.best_epoch, start_epoch, log)
        if epoch % self.interval == 0:
            self.checkpoint(self.output_dir / f"epoch_{epoch}.ckpt", state, epoch, progress)
            self.written_epochs.add(f"epoch_{epoch}.ckpt")
        self.write_csv(progress.history)

    def settle_restart(self, best_epoch: int, start_epoch: int, log: Callable[[str], None]) -> None:
        """After this run's first ``last.ckpt`` (or at the end of a restart that trains
        nothing): ``best.ckpt`` and the restart epoch's ``epoch_N.ckpt`` of the restart."""
        if self.restart_files is not None:
            with self.advising():
                written = self.restart_files.settle(best_epoch, start_epoch, self.interval, log)
            self.written_epochs.update(written)
            self.restart_files = None

    def write_csv(self, history: list[dict]) -> None:
        """``metrics.csv`` of ``history`` (nothing while it is empty)."""
        if history:
            text = csv_text(history)
            with self.advising():
                atomic_write(self.files["csv"], lambda handle: handle.write(text), text=True)

    def written(self) -> list[str]:
        """The names of the files this run wrote, sorted."""
        return sorted({p.name for p in self.files.values() if p.exists()} | self.written_epochs)


def prepare_folder(
    output_dir,
    restart,
    ckpt: Mapping | None,
    log: Callable[[str], None],
    *,
    interval: int,
    config: PETConfig,
    composition: np.ndarray,
    energy_scale: float,
    dtype: torch.dtype,
    seed: int,
    options: Mapping,
    split: Mapping,
    world_size: int,
) -> Folder:
    """The :class:`Folder` of a run writing into ``output_dir`` (created), after
    removing the temporary files a killed run left there (where this process holds
    the folder's lock, :mod:`petfunc.trainer.lock`: :func:`~petfunc.trainer.fit`
    takes it), with warnings for the checkpoints of other, finished runs it holds.
    Nothing else in the folder is replaced before this run's first ``last.ckpt``: a
    restart's ``best.ckpt`` and ``epoch_N.ckpt`` are settled then
    (:class:`RestartFiles`), so that a kill in the first epoch leaves the folder as
    it was. The keyword arguments are the checkpoints' fixed content
    (:func:`petfunc.io.write_checkpoint`); ``interval`` is ``checkpoint_interval``."""
    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    folder = Folder(
        output_dir,
        interval,
        config=config,
        composition=composition,
        energy_scale=energy_scale,
        dtype=dtype,
        seed=seed,
        options=options,
        split=split,
        world_size=world_size,
    )
    # a run killed while writing (SIGKILL, a lost node) leaves its temporary file; a
    # live run's are removed never: only a run holding the folder's lock cleans up
    leftovers = holds_lock(output_dir) and remove_leftover_temporaries(
        output_dir, [p.name for p in folder.files.values()] + ["parity_test.png", "epoch_*.ckpt"]
    )
    if leftovers:
        log(f"removed {len(leftovers)} temporary file(s) a killed run left in {output_dir}")
    if restart is not None:
        folder.restart_files = RestartFiles(Path(restart), ckpt, output_dir)
        folder.resume = (Path(restart), int(ckpt["epoch"]))
    _warn_of_other_runs(output_dir, restart, ckpt, log)
    return folder


def _warn_of_other_runs(output_dir: Path, restart, ckpt: Mapping | None, log: Callable[[str], None]) -> None:
    """Warn of the checkpoints in ``output_dir`` that this run replaces or leaves: those
    of another run, or those of later epochs of the run a restart continues."""
    same_folder = restart is not None and Path(restart).resolve().parent == output_dir.resolve()
    replaced = [
        name for name in ("last.ckpt", "best.ckpt") if not same_folder and (output_dir / name).exists()
    ]
    if replaced:
        log(
            f"warning: {output_dir} holds the {' and '.join(replaced)} of another run: this run replaces "
            f"them"
            + (
                ""
                if restart is not None
                else f" (to continue that run instead: --restart {output_dir / 'last.ckpt'})"
            )
        )
    start_epoch = 0 if ckpt is None else int(ckpt["epoch"])
    later = [
        name for n, name in sorted(epoch_files(output_dir).items()) if not same_folder or n > start_epoch
    ]
    if later:
        log(
            f"warning: {output_dir} holds {', '.join(later)} of "
            + (
                "later epochs of the run this restart continues, or of another run"
                if same_folder
                else "another run"
            )
            + ": they stay until this run writes those epochs"
        )


class RestartFiles:
    """What a restart needs to make its output folder agree with its checkpoint,
    read before this run writes anything (it may overwrite the restart file itself).

    ``best.ckpt`` must hold the checkpoint's best epoch while no epoch of this run
    beats it. It may not: a kill between writing ``last.ckpt`` and ``best.ckpt`` of an
    improving epoch, a restart from an earlier checkpoint into a folder that went
    further, a new folder. Its source is the restart checkpoint (when that is the best
    epoch), or the restart folder's ``best.ckpt`` or ``epoch_N.ckpt`` holding that
    epoch; without one, a stale ``best.ckpt`` is removed, with a log line (``--which
    best`` then reads the best parameters from ``last.ckpt``). The restart epoch's
    ``epoch_N.ckpt``, missing (a kill) or another run's, becomes the restart file."""

    def __init__(self, restart: Path, ckpt: Mapping, output_dir: Path):
        self.restart, self.ckpt, self.output_dir = restart, ckpt, output_dir
        self.epoch, self.best_epoch = int(ckpt["epoch"]), int(ckpt.get("best_epoch") or 0)
        self.best_flat = ckpt.get("best_params") or ckpt["params"]
        self.restart_bytes = restart.read_bytes()
        self.best_source = None
        folder = restart.resolve().parent
        for candidate in (restart, folder / "best.ckpt", folder / f"epoch_{self.best_epoch}.ckpt"):
            if (
                self.best_epoch
                and candidate.is_file()
                and self._holds(candidate, self.best_epoch, self.best_flat)
            ):
                self.best_source = (
                    candidate,
                    self.restart_bytes if candidate == restart else candidate.read_bytes(),
                )
                break

    def _holds(self, path: Path, epoch: int, flat) -> bool:
        if path.resolve() == self.restart.resolve():  # holds its own epoch, the best one if that is it
            return self.epoch == epoch
        try:
            other = read_checkpoint(path)
        except (OSError, ValueError):
            return False
        mine = other["params"]
        return (
            int(other.get("epoch", -1)) == epoch
            and mine.keys() == flat.keys()
            and all(torch.equal(mine[k], flat[k]) for k in mine)
        )

    def settle(self, best_epoch: int, start_epoch: int, interval: int, log) -> list[str]:
        """Write or remove ``best.ckpt`` and ``epoch_N.ckpt`` as the docstring says;
        returns the names of the epoch files written."""
        written = []
        best = self.output_dir / "best.ckpt"
        if (
            self.best_epoch
            and best_epoch <= start_epoch
            and not (best.is_file() and self._holds(best, self.best_epoch, self.best_flat))
        ):
            if self.best_source is not None:
                data = self.best_source[1]
                atomic_write(best, lambda handle: handle.write(data))
                log(
                    f"best.ckpt: epoch {self.best_epoch}, the best before this run, "
                    f"copied from {self.best_source[0]}"
                )
            else:
                removed = best.is_file()
                if removed:
                    best.unlink()
                log(
                    ("removed best.ckpt (another epoch's); " if removed else "no best.ckpt: ")
                    + f"the best epoch ({self.best_epoch}) came before this run "
                    "and its checkpoint is not at hand; '--which best' reads its parameters from last.ckpt"
                )
        numbered = self.output_dir / f"epoch_{self.epoch}.ckpt"
        if (
            self.epoch % interval == 0
            and numbered.resolve() != self.restart.resolve()
            and not (numbered.is_file() and self._holds(numbered, self.epoch, self.ckpt["params"]))
        ):
            data = self.restart_bytes
            atomic_write(numbered, lambda handle: handle.write(data))
            written.append(numbered.name)
        return written
