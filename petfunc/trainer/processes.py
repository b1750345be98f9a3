"""How a run is shared by processes: this process's rank, and the hooks that make
the processes train one model (the gradients' and the epoch metrics' reductions,
and the check that every process reads the same run).

:func:`fit` takes them as arguments; :func:`processes` checks them against the
``torch.distributed`` process group, if any, and fills in its defaults. The
training loop sees none of it: the step, the batches and the metric reduction it
is given are built from a :class:`Processes`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

from petfunc.distributed import all_reduce_metrics, check_same_run, current


def _unchanged(value):
    return value


def _nothing_to_compare(description: Mapping) -> None:
    del description  # one process, or processes without a process group: nothing to compare with


@dataclass(frozen=True)
class Processes:
    """This process's place in a run of ``world_size`` processes.

    Attributes:
        rank: this process (0 writes the files and the log).
        world_size: the number of processes; each takes its share of every batch.
        reduce_grads: ``grads -> grads`` between the gradient and the optimizer step
            (e.g. an all-reduce average), or ``None``: one process trains with one
            fused step, several with :class:`petfunc.distributed.DataParallel`.
        reduce_metrics: ``{name: float sum} -> {name: float sum}`` for the summed
            epoch metrics (all-reduce SUM in data-parallel training).
        check_same_run: raises unless every process describes the same run
            (:func:`petfunc.distributed.check_same_run`).
    """

    rank: int = 0
    world_size: int = 1
    reduce_grads: Callable | None = None
    reduce_metrics: Callable[[dict], dict] = _unchanged
    check_same_run: Callable[[Mapping], None] = _nothing_to_compare

    @property
    def is_main(self) -> bool:
        """Whether this process writes the files (rank 0)."""
        return self.rank == 0

    @property
    def split_step(self) -> bool:
        """Whether the step is a gradient step, a reduction and an optimizer step (a
        ``reduce_grads`` hook, or several processes), not one fused step."""
        return self.reduce_grads is not None or self.world_size > 1

    @property
    def data_parallel(self) -> bool:
        """Whether the step is :class:`petfunc.distributed.DataParallel`'s (several
        processes without a ``reduce_grads`` hook): global label counts, gradients
        all-reduced inside the step."""
        return self.world_size > 1 and self.reduce_grads is None


def processes(
    rank: int = 0,
    world_size: int = 1,
    reduce_grads: Callable | None = None,
    reduce_metrics: Callable | None = None,
) -> Processes:
    """The :class:`Processes` of ``fit(rank=, world_size=, reduce_grads=,
    reduce_metrics=)``.

    In a ``torch.distributed`` process group these must be this process's rank and
    the group's size; the epoch metrics are then all-reduced unless a
    ``reduce_metrics`` is given, and the processes compare their runs. Without a
    process group, several processes need both hooks (the caller's own
    communication): without them each process would train alone on its shard of
    every batch, or validate its own shard, and rank 0 would pick the best epoch
    from a part of the validation set.

    Raises:
        ValueError: a rank outside ``0 <= rank < world_size``, or one that does not
            match the process group, or several processes without a way to
            communicate.
    """
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or world_size < 1
        or not isinstance(rank, int)
        or not 0 <= rank < world_size
    ):
        raise ValueError(f"fit(rank={rank!r}, world_size={world_size!r}): need 0 <= rank < world_size")
    info = current()
    if info.distributed:
        if (info.rank, info.world_size) != (rank, world_size):
            # fit's defaults in a process group: every process would train alone,
            # all writing the same folder
            raise ValueError(
                f"fit(rank={rank}, world_size={world_size}), but this process is rank {info.rank} of a "
                f"process group of {info.world_size}: pass rank={info.rank}, world_size={info.world_size}"
            )
        return Processes(rank, world_size, reduce_grads, reduce_metrics or all_reduce_metrics, check_same_run)
    if world_size > 1 and (reduce_grads is None or reduce_metrics is None):
        raise ValueError(
            f"fit(world_size={world_size}) needs a torch.distributed process group of {world_size} processes "
            "(start them with torchrun and call petfunc.distributed.init_from_env() first), or the hooks "
            "reduce_grads and reduce_metrics that exchange the gradients and the epoch metrics"
        )
    return Processes(rank, world_size, reduce_grads, reduce_metrics or _unchanged)
