"""Malicious files, built by the tests themselves, for the loaders to refuse.

Each one, if run, creates a marker file; a test passes only if the marker never
appears. They are built from scratch (a pickle, a tiny C library), never shipped.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import shutil
import subprocess
import zipfile
from pathlib import Path


class _RunsCommand:
    """Unpickling this runs ``os.system(command)``."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def marker_command(marker: Path) -> str:
    """A shell command that creates ``marker``."""
    return f"touch {str(marker)!r}"


def disguised_pickle(path: Path, marker: Path) -> Path:
    """A ``torch.save``-style zip whose ``data.pkl`` runs a command when fully
    unpickled, with a dummy ``code/`` member that makes it look like a TorchScript
    export to a check that looks only for ``code/``."""
    payload = pickle.dumps({"state": _RunsCommand(marker_command(marker))}, protocol=2)
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("x/data.pkl", payload)
        archive.writestr("x/byteorder", "little")
        archive.writestr("x/version", "3\n")
        archive.writestr("x/code/a.py", "")
    return path


def code_running_pickle(path: Path, marker: Path, gzipped: bool = False) -> Path:
    """A plain ``torch.save`` archive (gzipped, as metatrain checkpoints may be) holding
    an object whose unpickling runs a command."""
    import gzip

    import torch

    buffer = io.BytesIO()
    torch.save({"model_state_dict": {}, "hook": _RunsCommand(marker_command(marker))}, buffer)
    path.write_bytes(gzip.compress(buffer.getvalue()) if gzipped else buffer.getvalue())
    return path


def compiler() -> str | None:
    """A C compiler on this machine, or ``None``."""
    return shutil.which("cc") or shutil.which("gcc")


def library_touching(path: Path, marker: Path) -> Path:
    """A shared library whose constructor creates ``marker`` when it is loaded."""
    source = path.with_suffix(".c")
    source.write_text(
        "#include <stdio.h>\n"
        "__attribute__((constructor)) static void on_load(void) {\n"
        f'    FILE *f = fopen("{marker}", "w"); if (f) fclose(f);\n'
        "}\n"
    )
    subprocess.run([compiler(), "-shared", "-fPIC", "-o", str(path), str(source)], check=True)
    return path


def library_in_archive(source: Path, path: Path, marker: Path) -> Path:
    """A copy of the ``petfunc export`` artifact ``source`` (exported without a
    library) that claims an AOTInductor library: one whose constructor creates
    ``marker`` when it is loaded."""
    library = library_touching(path.with_name(path.stem + "_library.so"), marker)
    with zipfile.ZipFile(source) as original, zipfile.ZipFile(path, "w") as archive:
        root = original.namelist()[0].split("/")[0]
        for info in original.infolist():
            data = original.read(info)
            if info.filename.endswith("extra/petfunc.json"):
                data = json.dumps({**json.loads(data), "aoti": True})
            archive.writestr(info.filename, data)
        folder = f"{root}/data/aotinductor/model"
        archive.write(library, f"{folder}/model.so")
        archive.writestr(f"{folder}/model_metadata.json", json.dumps({"AOTI_DEVICE_KEY": "cpu"}))
    return path
