"""The lock of a run's output folder: one training run writes into a folder at a time.

Two runs writing one folder would leave a mix of both (``last.ckpt`` of one,
``best.ckpt`` and ``options.yaml`` of the other), and the start-up clean-up of one
would remove the temporary file the other is writing. A run therefore holds an
exclusive ``flock`` on ``<folder>/.petfunc.lock`` from before it touches the folder
until it ends; a second run is refused with the holder's pid, host, start time and
command, which the holder writes into the lock file.

The operating system releases a ``flock`` when its process ends in any way (SIGKILL,
a lost node included), so the lock of a killed run is taken over by the next run
without a stale-lock check. A normal release removes the lock file. Where the file
system has no locks (NFS without ``lockd``, some FUSE mounts) the run goes on
unlocked after a warning; it then leaves the temporary files in the folder alone.
"""

from __future__ import annotations

import datetime
import errno
import json
import os
import shlex
import socket
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from petfunc.distributed import broadcast_object


try:
    import fcntl
except ImportError:  # not on POSIX: folders are not locked (a warning says so)
    fcntl = None


LOCK_NAME = ".petfunc.lock"

# errors of flock that mean another process holds the lock (the rest: no locks here)
_HELD_ERRNOS = (errno.EAGAIN, errno.EWOULDBLOCK, errno.EACCES)


class FolderInUseError(ValueError):
    """Another run holds the lock of the output folder (the message names it)."""


class Holder(NamedTuple):
    """The run that holds a folder's lock, as it wrote itself into the lock file.

    Attributes:
        pid: its process id.
        host: the host it runs on.
        started: when it took the lock (ISO 8601, local time with offset).
        command: its command line (shortened).
    """

    pid: int
    host: str
    started: str
    command: str

    def describe(self) -> str:
        """``COMMAND (pid N on host H, started T)``."""
        return f"{self.command} (pid {self.pid} on host {self.host}, started {self.started})"


def this_command() -> str:
    """This process's command line, as a holder names itself (200 characters at most)."""
    argv = list(sys.argv) or ["python"]
    name = Path(argv[0]).name or "python"
    if name == "__main__.py":  # python -m PACKAGE
        name = f"python -m {Path(argv[0]).parent.name}"
    return _printable(" ".join([name, *(shlex.quote(arg) for arg in argv[1:])]))


def _printable(value) -> str:
    """``value`` as text fit for a message: printable characters only (a lock file's
    text is another process's, or anyone's who can write the folder), 200 at most."""
    text = "".join(c if c.isprintable() else "?" for c in str(value))
    return text if len(text) <= 200 else text[:197] + "..."


def _parse_holder(text: str) -> Holder | None:
    try:
        fields = json.loads(text)
        return Holder(int(fields["pid"]), *(_printable(fields[k]) for k in ("host", "started", "command")))
    except (ValueError, TypeError, KeyError):
        return None  # empty (the holder has not written it yet) or not a holder's


def read_holder(folder) -> Holder | None:
    """The :class:`Holder` written in ``folder``'s lock file (``None``: none, or not
    readable). A holder that is not running any more (its lock released by its end)
    may still be written there: the lock, not the file, says who holds the folder."""
    try:
        return _parse_holder((Path(folder) / LOCK_NAME).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError):
        return None


def _in_use(folder: Path, holder: Holder | None) -> FolderInUseError:
    who = holder.describe() if holder is not None else "another process (it has not written its name yet)"
    return FolderInUseError(
        f"the run folder {str(folder)!r} is in use by {who}: choose another output folder "
        "(petfunc train -o/--output, fit's output_dir) or stop that run"
    )


class FolderLock:
    """The lock of a run folder held by this process (a context manager that releases
    it). Taken again by the same thread (``petfunc train`` and the :func:`fit` it
    calls), it is the same lock, released by the last release.

    Attributes:
        folder: the locked folder.
        path: the lock file.
        holder: this process, as written into the lock file.
        exclusive: whether the lock is an ``flock`` (``False``: the file system has
            none; nothing keeps another process out).
    """

    def __init__(self, folder: Path, key, fd: int | None, holder: Holder, made: list[Path]):
        self.folder, self.path, self.holder = folder, folder / LOCK_NAME, holder
        self.exclusive = fd is not None
        self._key, self._fd, self._made = key, fd, made  # made: the folders made for it, deepest first
        self._thread = threading.get_ident()
        self._depth = 1
        self._released = False

    def __enter__(self) -> FolderLock:
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def release(self) -> None:
        """Release one taking of the lock; the last one removes the lock file, closes it
        (which unlocks it) and removes the folders the lock made if they are empty.
        Releasing a released lock does nothing."""
        with _registry_lock:
            if self._released:
                return
            self._depth -= 1
            if self._depth > 0:
                return
            self._released = True
            _held.pop(self._key, None)
        try:
            if self._fd is not None:
                # unlink while locked, and only our own file: a process waiting on it
                # then finds it gone and opens a new one (see lock_folder)
                if _same_file(self._fd, self.path):
                    self.path.unlink()
        except OSError:
            pass
        finally:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None
        for made in self._made:
            try:
                made.rmdir()
            except OSError:
                break  # the run wrote into it (or someone else did): it stays


_held: dict[tuple[int, int], FolderLock] = {}  # the folders this process holds, by (device, inode)
_registry_lock = threading.Lock()


def _same_file(fd: int, path: Path) -> bool:
    try:
        mine, named = os.fstat(fd), os.stat(path)
    except OSError:
        return False
    return (mine.st_dev, mine.st_ino) == (named.st_dev, named.st_ino)


def lock_folder(
    folder, *, command: str | None = None, log: Callable[[str], None] | None = None
) -> FolderLock:
    """Lock the run folder ``folder`` (made if missing) for this process, writing the
    holder's pid, host, start time and ``command`` (default: this process's command
    line) into its lock file.

    Use it as a context manager, or call :meth:`FolderLock.release` on every exit.
    ``log`` gets the note on a lock taken over from a killed run and the warning
    where the file system has no locks (default: standard error).

    Raises:
        FolderInUseError: another process, or another thread of this one, holds the
            folder; the message names the holder.
        ValueError: the lock file is a symbolic link (it is never followed).
    """
    folder = Path(folder)
    log = log or (lambda message: print(message, file=sys.stderr))
    made = [p for p in (folder, *folder.parents) if not p.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    status = os.stat(folder)
    key = (status.st_dev, status.st_ino)
    with _registry_lock:
        held = _held.get(key)
        if held is not None:
            if held._thread != threading.get_ident():
                command = f"another thread of this process, {held.holder.command}"
                raise _in_use(folder, held.holder._replace(command=command))
            held._depth += 1
            return held
    fd, previous = _take(folder, log)
    holder = _me(command)
    if fd is not None:
        if previous is not None:
            log(
                f"note: took over the lock of {folder} from a run that ended without releasing it: {previous}"
            )
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(holder._asdict()).encode(), 0)
        except BaseException:
            os.close(fd)  # unlocks it
            raise
    lock = FolderLock(folder, key, fd, holder, made)
    with _registry_lock:
        _held[key] = lock
    return lock


def _me(command: str | None) -> Holder:
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    return Holder(os.getpid(), socket.gethostname(), started, command or this_command())


def _take(folder: Path, log: Callable[[str], None]) -> tuple[int | None, str | None]:
    """``(fd, previous holder's description)`` of the lock file of ``folder``, locked;
    ``(None, None)`` where the file system has no locks."""
    path = folder / LOCK_NAME
    if fcntl is None:
        _warn_unlocked(folder, "this platform has no flock", log)
        return None, None
    while True:
        try:
            # never through a link: the holder's details would be written where it points
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0), 0o644)
        except OSError as error:
            if error.errno == errno.ELOOP:
                raise ValueError(
                    f"the lock file {str(path)!r} of the run folder is a symbolic link, not petfunc's: "
                    "remove it, or choose another output folder"
                ) from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            holder = _parse_holder(_read(fd))
            os.close(fd)
            if error.errno in _HELD_ERRNOS:
                raise _in_use(folder, holder) from None
            if holder is None:  # the empty file this call made: not a lock of anyone's
                try:
                    if path.stat().st_size == 0:
                        path.unlink()
                except OSError:
                    pass
            _warn_unlocked(folder, f"flock: {error.strerror or error}", log)
            return None, None
        if _same_file(fd, path):
            previous = _parse_holder(_read(fd))
            return fd, None if previous is None else previous.describe()
        # the holder released (and removed) the file between our open and our flock:
        # the lock is on a file nobody else will open; start again with a new one
        os.close(fd)


def _read(fd: int) -> str:
    try:
        return os.pread(fd, 4096, 0).decode("utf-8", errors="replace")
    except OSError:
        return ""


def _warn_unlocked(folder: Path, why: str, log: Callable[[str], None]) -> None:
    log(
        f"warning: cannot lock the run folder {folder} ({why}; a file system without locks, such as NFS "
        "without lockd?): another run writing into it is not refused, and the temporary files a killed "
        "run left there are not removed"
    )


def holds_lock(folder) -> bool:
    """Whether this process holds ``folder``'s lock as an ``flock`` (so no other run
    writes there)."""
    try:
        status = os.stat(folder)
    except OSError:
        return False
    with _registry_lock:
        held = _held.get((status.st_dev, status.st_ino))
    return held is not None and held.exclusive


class _NotLocked:
    """The lock of a process that writes no folder: nothing to release."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        pass

    def release(self) -> None:
        pass


def lock_output_folder(output_dir, is_main: bool, log: Callable[[str], None] | None = None):
    """The lock of a run's ``output_dir`` (a context manager), taken by the process
    that writes it (``is_main``: rank 0; ``output_dir`` ``None``: nothing written).

    Every process of a ``torch.distributed`` process group must call it at the same
    point: rank 0's refusal is broadcast, so that all of them raise it rather than
    the others waiting for rank 0 in their next collective. The other ranks lock
    nothing, so the processes of one data-parallel run never refuse each other.

    Raises:
        FolderInUseError: another run holds the folder (on every process).
        ValueError: the lock file is a symbolic link (on every process).
    """
    lock, refusal = _NotLocked(), None
    if is_main and output_dir is not None:
        try:
            lock = lock_folder(output_dir, log=log)
        except ValueError as error:  # FolderInUseError, or a lock file that is a link
            refusal = (type(error).__name__, str(error))
    refusal = broadcast_object(refusal)
    if refusal is not None:
        lock.release()
        kind, message = refusal
        raise (FolderInUseError if kind == FolderInUseError.__name__ else ValueError)(message)
    return lock
