"""Writing a file so that a crash or a kill never leaves a partial one.

Below everything that writes files (parameters and checkpoints in :mod:`petfunc.io`,
the trace cache of :mod:`petfunc.compile`, the trainer's logs), so that none of them
imports a higher layer for it.
"""

from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path


PathLike = str | os.PathLike


def _umask() -> int:
    """The process's umask, read without changing it where Linux shows it."""
    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)  # elsewhere: set and restore (the only portable way)
    os.umask(mask)
    return mask


def _mode_for(path: Path) -> int:
    """Permissions the file at ``path`` gets: those of the file it replaces, or what
    ``open`` would give a new one (0o666 less the umask). ``mkstemp`` alone would
    leave every written file readable by its owner only."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError:
        return 0o666 & ~_umask()


def atomic_write(path: PathLike, write, text: bool = False) -> None:
    """``write(handle)`` into a temporary file next to ``path`` (binary, or UTF-8 text
    with ``text``), fsync, then rename it over ``path``.

    A crash or a kill leaves either the old file or the new one, never a partial
    one; a failing ``write`` removes the temporary file and re-raises. The file gets
    the permissions of the one it replaces, or those of a newly opened file.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        opened = os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")
        with opened as handle:
            write(handle)
            handle.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), _mode_for(path))
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def remove_leftover_temporaries(directory: PathLike, patterns) -> list:
    """Remove the temporary files that :func:`atomic_write` leaves when its process is
    killed (SIGKILL, a node lost) between creating one and renaming it, for the target
    names matching the glob ``patterns`` (``"last.ckpt"``, ``"epoch_*.ckpt"``).

    Call it only where no other process can be writing those names at the same time
    (the training run that owns ``directory``). Returns the removed paths.
    """
    directory = Path(directory)
    removed = []
    for pattern in patterns:
        for leftover in directory.glob(f".{pattern}.*.tmp"):
            try:
                leftover.unlink()
                removed.append(leftover)
            except FileNotFoundError:
                pass
    return removed


def not_a_file(path: PathLike, what: str) -> str:
    """The message for a ``path`` that is not a readable file: "no WHAT at PATH", or
    that it is a folder (a run's output folder given for its checkpoint, say)."""
    path = Path(path)
    if path.is_dir():
        return f"{str(path)!r} is a folder, not {what}"
    return f"no {what} at {str(path)!r}"
