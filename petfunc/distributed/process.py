"""The process group of data-parallel training: joining it from torchrun's
environment, leaving it, and the collectives petfunc needs (see
:mod:`petfunc.distributed`). A collective that fails raises
:class:`DistributedError` naming the rank, the step and the timeout instead of
hanging."""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.distributed as dist

from petfunc import tree
from petfunc.devices import resolve_device


DEFAULT_TIMEOUT_S = 600.0


class DistributedError(RuntimeError):
    """A collective failed: another rank stopped, or the timeout ran out."""


class RunMismatchError(ValueError):
    """The ranks read other options or data (:func:`check_same_run`); every rank
    raises it at the same point."""


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")
    backend: str | None = None
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def init_from_env(
    device: str | None = None,
    backend: str | None = None,
    timeout_s: float | None = None,
) -> DistInfo:
    """Join the process group described by torchrun's environment variables.

    Reads ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (and ``MASTER_ADDR``/``MASTER_PORT``
    through the ``env://`` rendezvous). Without ``WORLD_SIZE`` (or with 1) nothing is
    initialised and a one-process :class:`DistInfo` is returned.

    Args:
        device: ``"cpu"``, ``"cuda"`` or ``None`` (CUDA when available). On CUDA each
            process uses ``cuda:LOCAL_RANK``.
        backend: ``"gloo"`` / ``"nccl"``; default gloo on CPU, NCCL on CUDA.
        timeout_s: collective timeout in seconds (default ``$PETFUNC_DIST_TIMEOUT`` or
            600). A rank waiting longer for its peers raises instead of hanging.
    """
    if timeout_s is None:
        timeout_s = float(os.environ.get("PETFUNC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", str(rank)))
    device = resolve_device("auto" if device is None else device, "device")
    if device.type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    if world_size <= 1:
        return DistInfo(0, 1, 0, device, None, timeout_s)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda" and backend == "nccl":
        # make NCCL errors/timeouts raise in the waiting rank instead of hanging
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not dist.is_initialized():
        # without RANK every process would be rank 0 and wait for the others forever
        missing = [k for k in ("RANK", "MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(
                f"WORLD_SIZE={world_size} but {', '.join(missing)} not set: start with torchrun "
                "(or set RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT)"
            )
        kwargs = dict(
            backend=backend, rank=rank, world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s)
        )
        if device.type == "cuda":
            kwargs["device_id"] = device
        dist.init_process_group(**kwargs)
    return DistInfo(rank, world_size, local_rank, device, backend, timeout_s)


def current() -> DistInfo:
    """The :class:`DistInfo` of an already initialised process group (or one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return DistInfo()
    local_rank = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    backend = dist.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    timeout = float(os.environ.get("PETFUNC_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
    return DistInfo(dist.get_rank(), dist.get_world_size(), local_rank, device, backend, timeout)


def broadcast_object(obj, src: int = 0):
    """``obj`` of rank ``src`` on every rank (identity with one process)."""
    if not (dist.is_available() and dist.is_initialized()):
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    """Wait for all ranks (no-op with one process)."""
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def shutdown(wait_for_all: bool = True) -> None:
    """Leave the process group (no-op when none).

    Args:
        wait_for_all: first wait in a barrier until every rank has come to leave.
            Without it, a rank that tore its group down while rank 0 was still
            writing the last checkpoint and plots aborted at exit ("terminate
            called without an active exception") in 3 of 39 two-rank ``petfunc
            train`` runs under torchrun on gloo; with it, in none of 46.
            ``False`` on error paths, where the other ranks may never come.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if wait_for_all:
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - another rank left first: leave too
            pass
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# sharding


# ---------------------------------------------------------------------------------------
# the step


def is_sum(key: str) -> bool:
    """Whether a metric is a sum over structures (an error sum or a count), which
    ranks add up, rather than a value they share."""
    return key.endswith(("_sse", "_sae", "_count"))


def all_reduce_metrics(values: dict[str, float], info: DistInfo | None = None) -> dict[str, float]:
    """Epoch metrics across ranks: the ``reduce_metrics`` hook of
    :func:`petfunc.trainer.fit`. Every value there is a sum (batch losses, batch count,
    ``*_sse``/``*_sae``/``*_count``), so this is a SUM all-reduce; the means are taken
    after it. With ``DataParallel(metrics="share")`` every rank holds the union batch's
    loss, and the summed batch count is ``world_size`` times larger too, so the mean
    loss is unchanged. Every rank must pass the same keys."""
    return all_reduce_sums(values, info)


def all_reduce_sums(values: dict[str, float], info: DistInfo | None = None) -> dict[str, float]:
    """All-reduce (SUM) a ``{name: float}`` dict (epoch metric sums); identity with one process.
    Every rank must pass the same keys."""
    info = info or current()
    if not info.distributed:
        return dict(values)
    keys = sorted(values)
    buffer = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64)
    if info.backend == "nccl":
        buffer = buffer.to(info.device)
    try:
        dist.all_reduce(buffer)
    except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError
        raise collective_failed(info, "all_reduce of the epoch metrics failed", error) from error
    return dict(zip(keys, buffer.cpu().tolist()))


def collective_failed(info: DistInfo, what: str, error: Exception) -> DistributedError:
    """The error of a collective that failed on this rank."""
    first = str(error).splitlines()[0] if str(error) else ""
    return DistributedError(
        f"rank {info.rank}/{info.world_size}: {what}: another rank stopped (see its error) or did not answer "
        f"within the {info.timeout_s:g} s timeout ({type(error).__name__}: {first})"
    )


def check_same_run(description: Mapping, info: DistInfo | None = None) -> None:
    """Raise a ``ValueError`` on every rank when ``description`` (a nested dict of
    plain values: the resolved options, the data split, the fitted composition)
    differs between ranks; rank 0's names each difference from its own, the
    others' point to it.

    Each rank reads its own options file and data: a rank given another learning
    rate or seed trained a different model without a word (its gradients averaged
    with the others'), another batch size aborted in gloo, other epochs hung."""
    info = info or current()
    if not info.distributed:
        return
    described = [None] * info.world_size
    try:
        dist.all_gather_object(described, dict(description))
    except Exception as error:
        raise collective_failed(info, "comparing the ranks' options failed", error) from error
    differences = []
    for rank in range(1, info.world_size):
        changed = tree.differences(described[0], described[rank])
        if changed:
            differences.append(
                f"rank {rank}: " + "; ".join(changed[:5]) + (" ..." if len(changed) > 5 else "")
            )
    if differences:
        if info.rank != 0:  # rank 0 names them: one message, not one per process
            raise RunMismatchError(
                f"rank {info.rank}: the processes do not train the same run (rank 0's error "
                "names the differences)"
            )
        raise RunMismatchError(
            "the processes do not train the same run (each reads its own options and data; "
            "they must agree). Differences from rank 0's: " + " | ".join(differences)
        )
