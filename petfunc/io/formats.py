"""What kind of file a model file is, told from its archive, before anything loads it."""

from __future__ import annotations

import io
import os
import zipfile

from petfunc._files import PathLike


def is_petfunc_export(path: PathLike) -> bool:
    """Whether ``path`` is a PT2 archive written by ``petfunc export`` (it holds
    ``petfunc.json``; see :mod:`petfunc.export`)."""
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("extra/petfunc.json") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def is_torchscript(source) -> bool:
    """Whether ``source`` (the bytes or the path of a file) has the layout of a
    TorchScript archive (``torch.jit.save``, e.g. an exported metatomic model): a
    ``data.pkl``, a ``constants.pkl`` and compiled ``code/`` under one root folder.

    A ``torch.save`` pickle with a stray ``code/`` member is not one: telling the two
    apart by the layout keeps such a file away from loaders that fall back to
    unpickling it."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    if not zipfile.is_zipfile(source):
        return False
    try:
        with zipfile.ZipFile(source) as archive:
            names = archive.namelist()
    except (zipfile.BadZipFile, OSError):
        # found an end record, but a damaged directory: the loader that reads it
        # next says which file is unreadable
        return False
    roots = {name.split("/", 1)[0] for name in names if "/" in name}
    return any(
        f"{root}/data.pkl" in names
        and f"{root}/constants.pkl" in names
        and any(name.startswith(f"{root}/code/") for name in names)
        for root in roots
    )


def damage_of(path: PathLike) -> str:
    """Why a file that ``torch.load`` refused looks damaged, in a few words ("it is
    empty", "its archive is cut short"), or ``""`` where nothing shows."""
    try:
        if os.path.getsize(path) == 0:
            return "it is empty (0 bytes: an incomplete copy or write?)"
        with open(path, "rb") as handle:
            head = handle.read(4)
        if head == b"PK\x03\x04" and not zipfile.is_zipfile(path):
            return "its zip archive is cut short or damaged (an incomplete copy or write?)"
        if head != b"PK\x03\x04" and head[:1] != b"\x80" and head[:2] != b"\x1f\x8b":
            return "it is not a torch file (neither a zip archive nor a pickle)"
    except OSError:
        pass
    return ""


def pickled_objects(path: PathLike) -> list[str]:
    """The names of the Python objects a ``torch.save`` archive would unpickle beyond
    tensors and plain data (``"posix.system"``, ``"metatrain.utils...DatasetInfo"``),
    read without unpickling; empty for a file that is no readable archive."""
    import torch  # noqa: PLC0415 - the format checks above need no torch

    try:
        return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(path)))
    except Exception:  # noqa: BLE001 - not a torch archive at all
        return []


def refused_objects(path: PathLike, what: str) -> str:
    """The message for a file ``torch.load(weights_only=True)`` refused because it
    holds other Python objects or is compressed, or ``""`` where neither shows (a
    damaged file)."""
    try:
        with open(path, "rb") as handle:
            gzipped = handle.read(2) == b"\x1f\x8b"
    except OSError:
        gzipped = False
    if gzipped:  # petfunc writes none; metatrain's checkpoints may be
        return f"{str(path)!r} is not {what}: it is gzip-compressed, as petfunc's own files never are"
    names = pickled_objects(path)
    if not names:
        return ""
    return (
        f"{str(path)!r} is not {what}: it holds pickled Python objects ({', '.join(names[:5])}), "
        "which petfunc does not unpickle, since unpickling them could run code"
    )
