"""Launching tests/helpers/dist_worker.py as torchrun would: one process per rank."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.helpers import dist_worker


WORKER = Path(dist_worker.__file__)


def free_port():
    """A free TCP port on 127.0.0.1, for the rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank, world_size, port, **extra):
    """The environment torchrun gives process ``rank`` of ``world_size`` on this host
    (rendezvous on ``port``), one thread each, plus ``extra``."""
    return dict(
        os.environ,
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        OMP_NUM_THREADS="1",
        **extra,
    )


def launch(args, world_size=2, timeout=120, extra_env=None, only_rank0=False):
    """torchrun-like: one subprocess per rank; returns [(returncode, stderr)] and seconds.
    ``only_rank0``: stop the other ranks once rank 0 has exited."""
    port = free_port()
    procs = []
    t0 = time.perf_counter()
    for rank in range(world_size):
        env = rank_env(rank, world_size, port, **(extra_env or {}))
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            remaining = max(1.0, timeout - (time.perf_counter() - t0))
            _, err = p.communicate(timeout=remaining)
            results.append((p.returncode, err))
            if only_rank0:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, time.perf_counter() - t0
