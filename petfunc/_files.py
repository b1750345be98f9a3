"""Writing a file so that a crash or a kill never leaves a partial one.

Below everything that writes files (parameters and checkpoints in :mod:`petfunc.io`,
the trace cache of :mod:`petfunc.compile`, the trainer's logs), so that none of them
imports a higher layer for it.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path


PathLike = str | os.PathLike

#: the errno values of a write that found no room: a full file system, a used-up quota
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class NoSpaceError(OSError):
    """A file that could not be written for lack of room on its file system (``errno``
    ENOSPC) or in the user's quota (EDQUOT). Its message names the file system and
    says what became of the file; ``str()`` is that message alone."""

    def __str__(self) -> str:
        return str(self.strerror)


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


def atomic_write(path: PathLike, write, text: bool = False, what: str = "") -> None:
    """``write(handle)`` into a temporary file next to ``path`` (binary, or UTF-8 text
    with ``text``), fsync, then rename it over ``path``.

    A crash or a kill leaves either the old file or the new one, never a partial
    one; a failing ``write`` removes the temporary file and re-raises. The file gets
    the permissions of the one it replaces, or those of a newly opened file.

    Raises:
        NoSpaceError: the file system (or the quota) is full; ``path`` is unchanged,
            and the message says so, calling it "the previous ``what``" (a
            checkpoint, say) where given.
    """
    path = Path(path)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as error:  # no room even for an empty file (no free inodes, say)
        full = disk_full(error, path.parent)
        if full is None:
            raise
        raise no_space_error(path, full, what) from error
    try:
        opened = os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")
        with opened as handle:
            write(handle)
            handle.flush()
            if hasattr(os, "fchmod"):
                os.fchmod(handle.fileno(), _mode_for(path))
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException as error:
        full = disk_full(error, path.parent)  # while the temporary still fills the disk
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if full is not None:
            raise no_space_error(path, full, what) from error
        raise


def disk_full(error: BaseException, folder: PathLike) -> int | None:
    """The errno (ENOSPC or EDQUOT) when ``error`` comes of writing into ``folder``
    with no room left, else ``None``.

    That is an ``OSError`` with that errno, or one it was raised from or while
    handling, or torch's own writer error (``torch.save`` to a path reports a full
    disk as ``RuntimeError: [enforce fail at inline_container.cc] unexpected pos``)
    while less than a MiB is free in ``folder``.
    """
    seen = set()
    link = error
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, OSError) and link.errno in DISK_FULL:
            return link.errno
        link = link.__cause__ or link.__context__
    text = str(error)
    if isinstance(error, RuntimeError) and ("inline_container" in text or "PytorchStreamWriter" in text):
        try:
            if shutil.disk_usage(folder).free < 2**20:
                return errno.ENOSPC
        except OSError:
            pass
    return None


def mount_point(path: PathLike) -> Path:
    """The mount point of the file system holding ``path`` (an existing path)."""
    path = Path(os.path.abspath(path))
    while not os.path.ismount(path) and path.parent != path:
        path = path.parent
    return path


def no_space_error(path: PathLike, code: int, what: str = "") -> NoSpaceError:
    """The :class:`NoSpaceError` of writing ``path`` (left unchanged) with no room
    left (``code``: ENOSPC or EDQUOT); ``what`` the file is (``"checkpoint"``)."""
    path = Path(path)
    where = mount_point(path.parent)
    room = "disk quota exceeded" if code == errno.EDQUOT else "no space left"
    if path.is_file():
        fate = f"the previous {what} {path.name} is kept" if what else f"{path.name} is unchanged"
    else:
        fate = f"{path.name} was not written"
    return NoSpaceError(code, f"{room} on {where} (writing {path}); {fate}", str(path))


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
