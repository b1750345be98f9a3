"""Where ``petfunc train`` writes, as metatrain's ``mtt train`` does: the run folder
(``outputs/DATE/TIME`` by default), the exported model file of ``-o FILE``, and
the checkpoint that ``--restart auto`` continues.

``-o``/``--output`` takes either:

* a model file, a path ending in ``.pt2`` or ``.pt`` (``mtt train -o model.pt``):
  the best model is exported there at the end, and the run folder is the default
  one (``outputs/DATE/TIME``, or the checkpoint's folder of a restart);
* a run folder, any other path (``--output runs/a``, as before); a trailing ``/``
  makes any name a folder (``-o run.pt/``).

A model-file name that is an existing folder is an error (which was meant is
unclear), and so is a ``.ckpt`` name (the checkpoints go into the run folder).
"""

from __future__ import annotations

import datetime
import os
import re
from pathlib import Path

from petfunc.export import MODEL_SUFFIXES, check_model_file


#: the run folders ``petfunc train`` (and ``mtt train``) make: ``DATE/TIME`` under
#: ``outputs/``, with metatrain's ``.N`` after a time already taken
RUN_FOLDER = re.compile(r"\d{4}-\d{2}-\d{2}/\d{2}-\d{2}-\d{2}(\.\d+)?")


def default_run_folder(now: datetime.datetime | None = None) -> Path:
    """``outputs/DATE/TIME`` of now (metatrain's run folder)."""
    now = now or datetime.datetime.now()
    return Path("outputs") / now.strftime("%Y-%m-%d") / now.strftime("%H-%M-%S")


def split_output(output: str | None) -> tuple[Path | None, Path | None]:
    """``(run folder, model file)`` that ``-o output`` names (either may be ``None``:
    the default run folder, no exported model); see the module docstring.

    Raises:
        ValueError: a ``.ckpt`` name, a model-file name that is an existing folder, a
            metatomic model without the metatrain extra: said before training starts.
    """
    if output is None:
        return None, None
    if output.endswith(("/", os.sep)):
        return Path(output), None
    path = Path(output)
    if path.suffix == ".ckpt":
        raise ValueError(
            f"-o {output}: the checkpoints are written into the run folder; -o takes the exported "
            f"model's file ({' or '.join(MODEL_SUFFIXES)}) or the run folder"
        )
    if path.suffix not in MODEL_SUFFIXES:
        return path, None
    if path.is_dir():
        raise ValueError(
            f"-o {output}: a name ending in {path.suffix} is the exported model's file, but {output!r} is an "
            f"existing folder. Give another model file name, or write the run into that folder with "
            f"-o {output}/"
        )
    return None, check_model_file(path)


def newest_checkpoint(root="outputs") -> Path:
    """The checkpoint of ``--restart auto``: the newest ``last.ckpt`` (by the time it
    was written) of the run folders ``root/DATE/TIME/``, as metatrain takes the
    newest checkpoint under ``outputs/``.

    Raises:
        FileNotFoundError: there is none (the folder searched is named).
    """
    root = Path(root)
    found = [
        path
        for path in root.glob("*/*/last.ckpt")
        if RUN_FOLDER.fullmatch(f"{path.parent.parent.name}/{path.parent.name}") and path.is_file()
    ]
    if not found:
        raise FileNotFoundError(
            f"--restart auto: no checkpoint to continue: no DATE/TIME/last.ckpt in {str(root.resolve())!r} "
            "(runs started from the folder above it without -o DIR write there); "
            "give the checkpoint's path, --restart PATH/last.ckpt"
        )
    return max(found, key=lambda path: path.stat().st_mtime_ns)
