"""Which ``.pt2`` artifacts this machine exported, so that loading one runs only
native code this machine built.

An artifact with an AOTInductor library holds native code that runs in the process
that loads it: loading such a file is running a program. :func:`petfunc.export.export`
records the SHA-256 of every artifact with a library it writes; :func:`petfunc.export.load`
loads the library of a recorded file, and of any other file only when asked
(``aoti=True``). The record is a folder of empty files named by digest:
``$PETFUNC_CACHE_DIR/exports``, else ``$XDG_CACHE_HOME/petfunc/exports``, else
``~/.cache/petfunc/exports``.
"""

from __future__ import annotations

import hashlib
import os
import warnings
from pathlib import Path

from petfunc._files import PathLike, atomic_write


def exports_folder() -> Path:
    """The folder of digests of the artifacts this machine exported."""
    base = os.environ.get("PETFUNC_CACHE_DIR")
    if base:
        return Path(base) / "exports"
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg or Path.home() / ".cache") / "petfunc" / "exports"


def digest(path: PathLike) -> str:
    """The SHA-256 of the file at ``path``, as hex."""
    sha = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            sha.update(block)
    return sha.hexdigest()


def record(path: PathLike) -> None:
    """Record the artifact at ``path`` as exported here. A folder that cannot be
    written (a read-only home) only means its library needs ``aoti=True`` later."""
    folder = exports_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write(folder / digest(path), lambda handle: None)
    except OSError as error:
        warnings.warn(
            f"the export of {str(path)!r} could not be recorded in {str(folder)!r} ({error}): "
            "load its AOTInductor library with aoti=True",
            stacklevel=3,
        )


def recorded(path: PathLike) -> bool:
    """Whether the artifact at ``path`` is byte for byte one this machine exported."""
    return (exports_folder() / digest(path)).is_file()
