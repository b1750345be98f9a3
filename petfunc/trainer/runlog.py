"""The log of a run: what :func:`petfunc.trainer.fit` and ``petfunc train`` say goes
through :mod:`logging`, to the console and into ``<run folder>/train.log``.

Every line of a run is a record of the logger ``petfunc.trainer`` (``warning: ...``
lines at level WARNING, the others INFO). For the run's life :class:`RunLog`
attaches two handlers to the ``petfunc`` logger, so that records of every petfunc
module reach them:

- the console: each message handed to the run's ``log`` callable (by default
  ``tqdm.write`` to standard output, above the progress bar), as before;
- once the run folder is ready (process 0 only), ``train.log``: a header (versions,
  device, dtype, threads, command line, folder, units), the lines said before the
  folder was ready, then every line as it is said, each with its time and level.
  A restart appends to it after a line that names the restart; a new run starts it
  afresh.

Both handlers take only the records of the thread that runs the training, so two
runs in one process (each in its own thread and folder) never write into each
other's logs; both are removed, and the file closed, when the run ends in any way
(an error that ends it is the file's last line). Records also propagate to the root
logger, for an application's own handlers. For the run the ``petfunc`` logger passes
INFO records, unless a level was set on it. Progress bars stay on the console.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import logging
import platform
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import torch
from tqdm import tqdm

from petfunc._version import __version__


LOG_NAME = "train.log"
FILE_FORMAT = "[%(asctime)s][%(levelname)s] - %(message)s"

#: the logger of the training run's lines
logger = logging.getLogger("petfunc.trainer")
_PACKAGE = logging.getLogger("petfunc")


def default_log(message: str) -> None:
    """Write a progress line to stdout, above the progress bar."""
    tqdm.write(message, file=sys.stdout)


def say(message: str) -> None:
    """Log a line of the run: at level WARNING if it starts with ``warning:``, else INFO."""
    logger.log(logging.WARNING if message.startswith("warning:") else logging.INFO, message)


class ThisThread(logging.Filter):
    """Passes the records of the thread that made it only."""

    def __init__(self):
        super().__init__()
        self.thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        return record.thread == self.thread


class ConsoleHandler(logging.Handler):
    """Hands each record's message to ``write`` (``errors``: where records of level
    WARNING and above go instead; default ``write``). An exception ``write`` raises
    (a ``KeyboardInterrupt`` of a caller's own) reaches the code that logged."""

    def __init__(self, write: Callable[[str], None], errors: Callable[[str], None] | None = None):
        super().__init__()
        self.write, self.errors = write, errors or write
        self.addFilter(ThisThread())

    def emit(self, record: logging.LogRecord) -> None:
        (self.errors if record.levelno >= logging.WARNING else self.write)(record.getMessage())


class LogFile(logging.FileHandler):
    """``train.log`` (UTF-8, flushed after every line). A write that fails (a full
    disk) is said once to ``warn`` (the console); the log then goes on on the
    console only, and the run's own files say what failed."""

    def __init__(self, path: Path, mode: str, warn: Callable[[str], None]):
        super().__init__(path, mode=mode, encoding="utf-8")
        self.setFormatter(logging.Formatter(FILE_FORMAT))
        self.addFilter(ThisThread())
        self.warn = warn
        self.failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        if not self.failed:
            self.failed = True
            self.warn(
                f"warning: cannot write {self.baseFilename} ({sys.exc_info()[1]}); "
                "the log goes on on the console only"
            )


class _Held(logging.Handler):
    """Keeps this thread's records until the log file opens."""

    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []
        self.addFilter(ThisThread())

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


_levels_lock = threading.Lock()
_runs_lowering = [0]  # runs that need the petfunc logger at INFO
_level_before = [logging.NOTSET]


@contextlib.contextmanager
def _at_info():
    """The ``petfunc`` logger passes INFO records for the block unless a level was
    set on it (Python's default, WARNING from the root logger, would drop the run's
    lines); its level is put back after the last such block of any thread."""
    with _levels_lock:
        if _runs_lowering[0] == 0:
            _level_before[0] = _PACKAGE.level
            if _PACKAGE.level == logging.NOTSET and _PACKAGE.getEffectiveLevel() > logging.INFO:
                _PACKAGE.setLevel(logging.INFO)
        _runs_lowering[0] += 1
    try:
        yield
    finally:
        with _levels_lock:
            _runs_lowering[0] -= 1
            if _runs_lowering[0] == 0:
                _PACKAGE.setLevel(_level_before[0])


@contextlib.contextmanager
def console(write: Callable[[str], None] | None = None, errors: Callable[[str], None] | None = None):
    """For the block, this thread's records of the ``petfunc`` loggers (INFO and above)
    go to ``write`` (default :func:`default_log`; ``errors``: where WARNING and above
    go, default ``write``)."""
    handler = ConsoleHandler(write or default_log, errors)
    with _at_info():
        _PACKAGE.addHandler(handler)
        try:
            yield handler
        finally:
            _PACKAGE.removeHandler(handler)


class RunLog:
    """The log of one run (a context manager): the console from the start,
    ``train.log`` inside :meth:`writing`; see the module docstring.

    Args:
        write: the console (the run's ``log`` callable).
    """

    def __init__(self, write: Callable[[str], None]):
        self.write = write
        self._held: _Held | None = None
        self._console: ConsoleHandler | None = None
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> RunLog:
        self._stack.enter_context(_at_info())
        self._held = _Held()
        _PACKAGE.addHandler(self._held)
        self._stack.callback(self._drop_held)
        self._console = self._stack.enter_context(console(self.write))
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def without_file(self) -> None:
        """No file is written (no run folder, or a process other than 0): the lines
        held for it are dropped."""
        self._drop_held()

    def _drop_held(self) -> None:
        if self._held is not None:
            _PACKAGE.removeHandler(self._held)
            self._held = None

    @contextlib.contextmanager
    def writing(self, path: Path, header: list[str], restart=None):
        """For the block, the run's lines also go to the log file ``path``: appended
        after a line naming the ``restart`` checkpoint (a new run: written afresh),
        ``header``, the lines held since the run began, then every line as it is
        said. An error that ends the block is its last line; the file is closed on
        every exit (enter it inside the folder's lock: no line is written after the
        lock is released)."""
        file = LogFile(Path(path), "a" if restart is not None else "w", self.write)
        try:
            if restart is not None:
                file.handle(_record(logging.INFO, f"{'=' * 20} restart from {restart} {'=' * 20}"))
            for line in header:
                file.handle(_record(logging.INFO, line))
            held = self._held.records if self._held is not None else []
            self._drop_held()
            for record in held:
                file.handle(record)
            # before the console: a console that raises (a caller stopping the run)
            # leaves its line in the file too
            _PACKAGE.removeHandler(self._console)
            _PACKAGE.addHandler(file)
            _PACKAGE.addHandler(self._console)
            yield file
        except BaseException as error:
            file.handle(_record(logging.ERROR, ended_by(error)))
            raise
        finally:
            _PACKAGE.removeHandler(file)
            file.close()


def _record(level: int, message: str) -> logging.LogRecord:
    return logger.makeRecord(logger.name, level, __file__, 0, message, None, None)


def ended_by(error: BaseException) -> str:
    """The last line of the log of a run that ``error`` ended."""
    if isinstance(error, KeyboardInterrupt):
        return f"the run stopped: {type(error).__name__} (interrupted or terminated)"
    text = " ".join(str(error).split())
    return f"the run stopped: {type(error).__name__}: {text}"


def versions() -> str:
    """``petfunc X, torch Y[, metatrain Z], Python W``."""
    parts = [f"petfunc {__version__}", f"torch {torch.__version__}"]
    try:
        parts.append(f"metatrain {importlib.metadata.version('metatrain')}")
    except importlib.metadata.PackageNotFoundError:
        pass
    parts.append(f"Python {platform.python_version()}")
    return ", ".join(parts)


def device_name(device: torch.device) -> str:
    """``cpu``, or ``cuda:N (GPU NAME)``."""
    device = torch.device(device)
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def units_lines(per_atom: bool) -> list[str]:
    """What the numbers of the log and of ``metrics.csv`` are measured in."""
    energy = "energy per atom, eV/atom" if per_atom else "energy per structure, eV"
    strain = "V·σ/N, eV/atom" if per_atom else "V·σ, eV"
    return [
        f"units: epoch lines and metrics.csv: E (energy_*) {energy}; F (forces_*) eV/Å; "
        f"S (stress_*) the strain derivative {strain}; loss in training units (energies divided "
        "by the energy scale, dimensionless); lr (learning_rate) dimensionless; time_s seconds",
        "units: composition weights and energy scale eV; test and final RMSE/MAE: energy per atom eV/atom, "
        "forces eV/Å, stress eV/Å³",
    ]


def header(
    *,
    folder: Path,
    command: str,
    device: torch.device,
    dtype: torch.dtype,
    world_size: int,
    per_atom: bool,
    restart=None,
) -> list[str]:
    """The first lines of a run's ``train.log``."""
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    dtype_name = str(dtype).replace("torch.", "")
    return [
        f"petfunc training run in {Path(folder).resolve()}, started {started}"
        + (f", restarted from {restart}" if restart is not None else ""),
        f"command: {command}",
        f"versions: {versions()}",
        f"device: {device_name(device)}; dtype {dtype_name}; {torch.get_num_threads()} threads; "
        f"{world_size} process{'es' if world_size > 1 else ''}",
        *units_lines(per_atom),
    ]
