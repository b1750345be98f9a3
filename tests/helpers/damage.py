"""Damaged copies of petfunc's files, as bit rot, a cut-short copy or a full disk
leave them: a flipped bit in a tensor or a number inside a ``torch.save`` archive,
truncated, random and empty files; file handles that run out of room, and a small
tmpfs that does."""

import contextlib
import errno
import io
import os
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch


def _member_data_offset(data: bytes, info: zipfile.ZipInfo) -> int:
    """Where the (stored, uncompressed) bytes of a zip member begin in the archive."""
    start = info.header_offset
    name_length, extra_length = struct.unpack("<HH", data[start + 26 : start + 30])
    return start + 30 + name_length + extra_length


def _flip(path, member_suffix: str, byte: int, bit: int) -> None:
    """Flip ``bit`` of byte ``byte`` of the archive member whose name ends with
    ``member_suffix``, in place, leaving the archive's CRC as it was."""
    path = Path(path)
    data = bytearray(path.read_bytes())
    with zipfile.ZipFile(io.BytesIO(bytes(data))) as archive:
        (info,) = [i for i in archive.infolist() if i.filename.endswith(member_suffix)]
        assert info.compress_type == zipfile.ZIP_STORED and byte < info.file_size
        offset = _member_data_offset(bytes(data), info)
    data[offset + byte] ^= 1 << bit
    path.write_bytes(bytes(data))


def flip_bit_in_tensor(path, tensor: torch.Tensor, element: int = 0, bit: int | None = None) -> None:
    """Flip one bit of ``element`` of ``tensor`` (as loaded from ``path``) in the file,
    found by its bytes: by default the top exponent bit of a float, which makes a
    weight of order one about 1e306 (float64) or 1e38 (float32)."""
    item = tensor.element_size()
    if bit is None:
        bit = 8 * item - 2  # the highest exponent bit of an IEEE float
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    with zipfile.ZipFile(path) as archive:
        owners = [
            i.filename
            for i in archive.infolist()
            if "/data/" in i.filename and archive.read(i.filename)[: len(raw)] == raw
        ]
    assert owners, "no storage of the file holds the tensor"
    # little-endian: the byte of the highest bits comes last
    _flip(path, owners[0], element * item + bit // 8, bit % 8)


def flip_bit_in_float(path, value: float) -> None:
    """Flip the lowest mantissa bit of the pickled Python float ``value`` (an energy
    scale, a metric) in the file's ``data.pkl``."""
    with zipfile.ZipFile(path) as archive:
        (name,) = [n for n in archive.namelist() if n.endswith("data.pkl")]
        pickled = archive.read(name)
    at = pickled.find(b"G" + struct.pack(">d", value))  # BINFLOAT: big-endian
    assert at >= 0, f"{value!r} is not pickled in {path}"
    _flip(path, "data.pkl", at + 8, 0)


def truncate(path, keep: float = 0.5) -> None:
    """Keep the first ``keep`` fraction of the file's bytes (an interrupted copy)."""
    data = Path(path).read_bytes()
    Path(path).write_bytes(data[: int(len(data) * keep)])


def random_file(path, size: int = 4096, seed: int = 0) -> Path:
    """A file of ``size`` random bytes."""
    Path(path).write_bytes(np.random.default_rng(seed).bytes(size))
    return Path(path)


def empty_file(path) -> Path:
    """An empty file (a copy or a write that never began)."""
    Path(path).write_bytes(b"")
    return Path(path)


def without_digest(path) -> None:
    """Rewrite a petfunc file as it was written before petfunc stored a digest."""
    payload = torch.load(path, weights_only=True)
    payload.pop("digest", None)
    torch.save(payload, path)


class FullHandle:
    """A binary file handle that takes ``room`` bytes, then raises ENOSPC, as a write
    into a full file system does."""

    def __init__(self, handle, room: int):
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        size = memoryview(data).nbytes
        if size > self.room:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= size
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()
        return False


def fill_disk_after(monkeypatch, room: int = 0, when=lambda: True) -> None:
    """Make the files ``os.fdopen`` opens for binary writing (the temporary files of
    :func:`petfunc.io.atomic_write`) while ``when()`` is true run out of room after
    ``room`` bytes."""
    real = os.fdopen

    def fdopen(fd, mode="r", *args, **kwargs):
        handle = real(fd, mode, *args, **kwargs)
        return FullHandle(handle, room) if "w" in mode and "b" in mode and when() else handle

    monkeypatch.setattr(os, "fdopen", fdopen)


@contextlib.contextmanager
def small_tmpfs(folder, size: str):
    """A tmpfs of ``size`` (``"256k"``) mounted at ``folder`` (created) for the
    block; skips the test where mounting is not permitted (no root, a container
    without CAP_SYS_ADMIN, not Linux)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    mount = shutil.which("mount")
    if mount is None or not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("mounting a small tmpfs needs root and mount(8)")
    done = subprocess.run(
        [mount, "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"mounting a small tmpfs is not permitted here: {done.stderr.strip()}")
    try:
        yield folder
    finally:
        subprocess.run([shutil.which("umount") or "umount", str(folder)], check=False)


SMALL_CONFIG = dict(atomic_types=(1, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)


def small_checkpoint(path, epoch: int = 3, config=None) -> Path:
    """A training checkpoint of a small PET (``config``: a PETConfig, default 2
    species, d_pet=8) after ``epoch`` epochs, as ``petfunc train`` writes it."""
    import petfunc
    from petfunc.io import write_checkpoint

    config = config or petfunc.PETConfig(**SMALL_CONFIG)
    params = petfunc.PET(config).init(seed=epoch)
    best = petfunc.PET(config).init(seed=epoch + 100)
    state = petfunc.init_state(params, petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 10)))
    write_checkpoint(
        path,
        config=config,
        params=state.params,
        opt_state=state.opt_state,
        epoch=epoch,
        step=4 * epoch,
        best_epoch=epoch,
        best_metric=0.25,
        best_params=best,
        composition=[-1.5, -3.0] + [0.0] * (len(config.atomic_types) - 2),
        energy_scale=0.5,
        dtype=torch.float32,
        seed=7,
        options={"seed": 7, "architecture": {"name": "pet"}, "training_set": "train.xyz"},
        history=[{"epoch": e + 1, "loss": 2.0 / (e + 1)} for e in range(epoch)],
        split={"training": [[0, 1]]},
        world_size=1,
        version=petfunc.__version__,
    )
    return Path(path)
