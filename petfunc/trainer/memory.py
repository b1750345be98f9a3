"""Out of memory in a run: the allocator's error (CUDA's ``torch.OutOfMemoryError``,
the CPU allocator's ``RuntimeError``, Python's ``MemoryError``) becomes one
:class:`OutOfMemory` whose message says what was being done (the training step of
epoch N, batch M, its structures, atoms and edges; the validation; an evaluation)
and what to change, instead of a traceback."""

from __future__ import annotations

import contextlib
import re

import torch

from petfunc.trainer.metrics import TrainingError


class OutOfMemory(TrainingError):
    """The memory of the device ran out (the message names where and what to change).
    The checkpoints written before are intact; the original error is its
    ``__cause__``."""


_CUDA_ERRORS = tuple(
    {getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError), torch.cuda.OutOfMemoryError}
)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocator's: CUDA out of memory, the CPU allocator's
    ``can't allocate memory``, or a ``MemoryError``."""
    if isinstance(error, (MemoryError, *_CUDA_ERRORS)):
        return True
    if isinstance(error, RuntimeError) and not isinstance(error, TrainingError):
        text = str(error)
        return "DefaultCPUAllocator: can't allocate memory" in text or "out of memory" in text.lower()
    return False


def _asked(error: BaseException) -> str:
    """How much the failed allocation asked for, as the allocator says it (or '')."""
    text = str(error)
    found = re.search(r"[Tt]ried to allocate ([0-9.]+ ?[KMGTP]?i?B)", text)
    if found:
        return found.group(1)
    found = re.search(r"allocate (\d+) bytes", text)
    if found:
        return f"{int(found.group(1)) / 2**30:.2f} GiB"
    return ""


def _where(device) -> str:
    device = torch.device(device) if device is not None else torch.device("cpu")
    if device.type == "cuda":
        try:
            index = device.index if device.index is not None else torch.cuda.current_device()
            return f"{device} ({torch.cuda.get_device_name(index)})"
        except (RuntimeError, AssertionError):
            return str(device)
    return "the CPU" if device.type == "cpu" else str(device)


def batch_size_text(batch) -> str:
    """``N structures, M atoms, K edges`` of a :class:`petfunc.data.Batch` (or of
    a tuple ``(positions, cell, neighbors)``)."""
    try:
        if hasattr(batch, "positions"):
            positions, cell, neighbors = batch.positions, batch.cell, batch.neighbors
        else:
            positions, cell, neighbors = batch[:3]
        structures, atoms, edges = cell.shape[0], positions.shape[0], neighbors.centers.shape[0]
    except (AttributeError, TypeError, ValueError, IndexError):
        return ""
    return f"{structures} structures, {atoms} atoms, {edges} edges"


def out_of_memory(error: BaseException, doing: str, device, advice: str, size: str = "") -> OutOfMemory:
    """The :class:`OutOfMemory` of the allocator's ``error`` on ``device``, raised
    while ``doing`` (e.g. ``in the training step of epoch 3, batch 7 of 12``) on a
    batch of ``size`` (e.g. ``4 structures, 96 atoms, 1210 edges``), saying ``advice``."""
    asked = _asked(error)
    details = "; ".join(part for part in (size, asked and f"it asked for {asked} more") if part)
    return OutOfMemory(
        f"out of memory on {_where(device)} {doing}" + (f" ({details})" if details else "") + f": {advice}"
    )


def training_advice(options, step: bool = True) -> str:
    """What to change in the resolved ``options`` of a run whose training ``step``
    (else: its validation) ran out of memory."""
    training = options["architecture"]["training"]
    model = options["architecture"]["model"]
    if training.get("max_atoms_per_batch"):
        ways = [f"lower architecture.training.max_atoms_per_batch (now {training['max_atoms_per_batch']})"]
    else:
        ways = [f"lower architecture.training.batch_size (now {training['batch_size']}; --batch-size)"]
    if step and not training.get("remat") and not training.get("compile"):
        ways.append(
            "set architecture.training.remat: true (--remat; eager steps, most for energy-only losses)"
        )
    if options.get("base_precision") == 64:
        ways.append("train in float32 (base_precision: 32, --dtype float32)")
    ways.append(
        f"use fewer neighbours (a smaller architecture.model.cutoff, now {model.get('cutoff')} Å, "
        "or num_neighbors_adaptive)"
    )
    return ", ".join(ways[:-1]) + " or " + ways[-1]


EVALUATION_ADVICE = (
    "evaluate fewer structures at a time (--batch-size), in float32 (--dtype float32), "
    "or on a device with more memory"
)


@contextlib.contextmanager
def reporting_out_of_memory(doing: str, device, advice: str, batch=None):
    """Inside the block, an allocator's error becomes :func:`out_of_memory`'s
    :class:`OutOfMemory`: ``doing`` says what the block does, with the size of the
    ``batch`` (a :class:`petfunc.data.Batch`) it does it on, if given."""
    try:
        yield
    except BaseException as error:
        if not is_out_of_memory(error):
            raise
        size = batch_size_text(batch) if batch is not None else ""
        raise out_of_memory(error, doing, device, advice, size) from error
