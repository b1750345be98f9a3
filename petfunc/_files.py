"""Writing a file so that a crash or a kill never leaves a partial one.

Below everything that writes files (parameters and checkpoints in :mod:`petfunc.io`,
the trace cache of :mod:`petfunc.compile`, the trainer's logs), so that none of them
imports a higher layer for it.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Union

PathLike = Union[str, os.PathLike]


def atomic_write(path: PathLike, write, text: bool = False) -> None:
    """``write(handle)`` into a temporary file next to ``path`` (binary, or UTF-8 text
    with ``text``), fsync, then rename it over ``path``.

    A crash or a kill leaves either the old file or the new one, never a partial
    one; a failing ``write`` removes the temporary file and re-raises.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        opened = os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")
        with opened as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
