"""Allocator errors as CUDA and the CPU raise them, a training or validation step
that raises one, and a run folder held as another process holds it."""

import fcntl
import json
import logging
import os

import torch

from petfunc.trainer.lock import LOCK_NAME
from petfunc.trainer.steps import TrainStep, Validate


def cuda_out_of_memory():
    """CUDA's error, as the caching allocator words it."""
    return torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        "of which 1.06 GiB is free. Of the allocated memory 75.1 GiB is allocated by PyTorch"
    )


def cpu_out_of_memory():
    """The CPU allocator's error."""
    return RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: "
        "you tried to allocate 34359738368 bytes. Error code 12 (Cannot allocate memory)"
    )


ALLOCATOR_ERRORS = {"cuda": cuda_out_of_memory, "cpu": cpu_out_of_memory, "python": MemoryError}


def raise_in_step(monkeypatch, make_error, at_call=1, validation=False):
    """From its ``at_call``-th call on, the training step (``validation``: the
    validation step) raises ``make_error()``."""
    cls = Validate if validation else TrainStep
    original = cls.__call__
    calls = [0]

    def failing(self, *args):
        calls[0] += 1
        if calls[0] >= at_call:
            raise make_error()
        return original(self, *args)

    monkeypatch.setattr(cls, "__call__", failing)
    return calls


def hold_folder(folder):
    """Lock ``folder`` through a descriptor of its own, as another process holds it;
    returns the descriptor (close it to release)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {
        "pid": 4242,
        "host": "node7",
        "started": "2025-01-02T03:04:05+00:00",
        "command": "petfunc train",
    }
    os.write(fd, json.dumps(holder).encode())
    return fd


def petfunc_handlers():
    """The handlers attached to the ``petfunc`` loggers."""
    names = [
        name for name in logging.root.manager.loggerDict if name == "petfunc" or name.startswith("petfunc.")
    ]
    return [h for name in names for h in getattr(logging.getLogger(name), "handlers", [])]
