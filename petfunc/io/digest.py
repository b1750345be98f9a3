"""The content digest of petfunc's own files (training checkpoints, parameter files).

``torch.load`` checks no checksum: a flipped bit in a tensor's bytes, or in a
number of the pickle (an energy scale, an epoch), loads without a word. Every
checkpoint and parameter file petfunc writes therefore stores, under
:data:`DIGEST_KEY`, a SHA-256 of everything else it holds, and every reader
recomputes it (:func:`check_digest`); a file without the key (written before
petfunc stored one) loads unchecked.

The digest covers the whole payload in a fixed order: dict entries sorted by key,
list and tuple items in their order; each tensor's place (its path of keys),
dtype, shape and raw bytes (the machine's byte order, little-endian everywhere
torch runs), and each plain value (``None``, bools, ints, floats, strings, bytes)
by type and exact value. It does not depend on the order a dict was built in.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Mapping
from pathlib import Path

import torch


#: the payload key holding the digest, ``"sha256:<64 hex digits>"``
DIGEST_KEY = "digest"
ALGORITHM = "sha256"


class DamagedFileError(ValueError):
    """A file whose content does not match the digest stored in it: bit rot on the
    disk, an incomplete or altered copy. Its message names the file."""


def _field(hasher, data: bytes) -> None:
    """``data`` with its length in front, so that no two sequences of fields hash alike."""
    hasher.update(struct.pack("<Q", len(data)))
    hasher.update(data)


def _tensor_bytes(tensor: torch.Tensor):
    """The raw bytes of ``tensor``'s values in row-major order, as a 1-D uint8 array
    (a view of the tensor where it is contiguous)."""
    flat = tensor.detach().to("cpu").resolve_conj().resolve_neg().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy() if flat.numel() else b""


def _update(hasher, value, where: str) -> None:
    """Feed ``value`` (found at ``where``, its path of keys) into ``hasher``."""
    if isinstance(value, torch.Tensor):
        if value.layout != torch.strided or value.is_quantized:
            raise TypeError(f"{where}: cannot digest a {value.layout} tensor")
        _field(hasher, b"T" + where.encode("utf-8", "surrogatepass"))
        _field(hasher, str(value.dtype).encode())
        _field(hasher, struct.pack(f"<{value.dim()}q", *value.shape))
        _field(hasher, _tensor_bytes(value))
    elif isinstance(value, Mapping):
        keys = sorted(value, key=lambda k: (type(k).__name__, repr(k)))
        _field(hasher, b"D" + str(len(keys)).encode())
        for key in keys:
            _update(hasher, key, f"{where}/<key>")
            _update(hasher, value[key], f"{where}/{key}")
    elif isinstance(value, (list, tuple)):
        _field(hasher, (b"L" if isinstance(value, list) else b"U") + str(len(value)).encode())
        for index, item in enumerate(value):
            _update(hasher, item, f"{where}/{index}")
    else:
        _field(hasher, _plain(value, where))


def _plain(value, where: str) -> bytes:
    """A plain value as a type tag and its exact value."""
    if value is None:
        return b"N"
    if isinstance(value, bool):  # before int: a bool is an int
        return b"B1" if value else b"B0"
    if isinstance(value, int):
        return b"I" + int.__repr__(value).encode()
    if isinstance(value, float):
        return b"F" + struct.pack("<d", value)  # every bit, NaN payloads and -0.0 too
    if isinstance(value, str):
        return b"S" + value.encode("utf-8", "surrogatepass")
    if isinstance(value, bytes):
        return b"Y" + value
    if isinstance(value, (torch.dtype, torch.device, torch.Size)):
        return b"O" + type(value).__name__.encode() + b":" + str(value).encode()
    raise TypeError(f"{where}: cannot digest a value of type {type(value).__name__}")


def payload_digest(payload: Mapping) -> str:
    """``"sha256:<hex>"`` of everything in ``payload`` except its :data:`DIGEST_KEY`.

    Raises ``TypeError`` for a value other than tensors (strided), dicts, lists,
    tuples and plain values.
    """
    hasher = hashlib.sha256()
    _update(hasher, {k: v for k, v in payload.items() if k != DIGEST_KEY}, "")
    return f"{ALGORITHM}:{hasher.hexdigest()}"


def with_digest(payload: Mapping) -> dict:
    """``payload`` with its :func:`payload_digest` under :data:`DIGEST_KEY` (a new dict)."""
    out = {k: v for k, v in payload.items() if k != DIGEST_KEY}
    out[DIGEST_KEY] = payload_digest(out)
    return out


def has_digest(payload) -> bool:
    """Whether a loaded ``payload`` stores a digest (files written before petfunc
    stored one do not)."""
    return isinstance(payload, Mapping) and DIGEST_KEY in payload


def check_digest(payload, path) -> None:
    """Raise :class:`DamagedFileError` naming ``path`` if the loaded ``payload`` stores
    a digest that its content does not match; a payload without one passes."""
    if not has_digest(payload):
        return
    stored = payload[DIGEST_KEY]
    try:
        actual = payload_digest(payload)
    except TypeError as error:  # a damaged pickle can hold anything weights_only allows
        actual = f"none ({error})"
    if stored != actual:
        raise DamagedFileError(
            f"{str(Path(path))!r} is damaged: its content does not match the digest stored in "
            "it (bit rot on the disk, an incomplete copy, or an edit stored without a new digest: "
            "petfunc.io.digest.with_digest); do not use it"
        )
