"""Data-parallel training on ``torch.distributed``, without DDP wrappers.

The gradients of :func:`petfunc.train.make_grad_step` are plain outputs, so data
parallelism is: every rank computes the gradient on its own shard of the batch,
one ``all_reduce`` sums the gradients, and every rank applies the identical
optimizer update (:func:`petfunc.train.apply_gradients`). No DDP bucketing, no
hooks, no ``optimize_ddp``: DDP's gradient hooks do not trace into the one graph of a
grad-of-grad step, and splitting it per bucket recompiles.

Exactness. The loss of a batch is ``L = sum_t w_t (sum of l over the labels of
term t) / N_t`` (``t``: energy, forces, stress; ``N_t``: non-NaN labels of term t).
Averaging the per-rank gradients of the per-rank means is exact only when every
rank holds the same number of labels of every term. Here each rank instead
differentiates

    L_r = sum_t w_t (n_{t,r} / N_t) mean_{t,r}  =  sum_t w_t (sum over rank r's labels of l) / N_t,

with the *global* counts ``N_t = sum_r n_{t,r}`` (all-reduced from the batch targets
before the step: one tiny collective), so ``sum_r L_r`` is the loss of the union
batch and the SUM of the per-rank gradients is its gradient, to round-off. A term
with ``reduction="sum"`` has no ``1/N_t``: its factor is 1, as the sum of the ranks'
sums is the union's sum. Clipping and Adam then see the same gradient as a
one-process run on the union batch.

Shapes. Every rank's batch is padded by :func:`petfunc.data.make_batch` so no size is
0 or 1: the compiled step sees the same 0/1 specialisations on every rank, and no
rank recompiles alone (torch specialises a graph on sizes 0 and 1; a rank
recompiling while the others wait in a collective would stall them).

Failures. :func:`init_from_env` sets a timeout on the process group; a collective
that fails (a peer died or timed out) raises :class:`DistributedError` naming the
rank, the step and the timeout instead of hanging. Under ``torchrun`` the agent
also stops the other ranks when one exits with an error.

Only rank 0 writes files (:func:`save_checkpoint`).

Typical use (``torchrun --nproc_per_node=2 script.py``)::

    info = init_from_env()
    dp = DataParallel(model, optimizer, weights, grad_clip_norm=1.0, compile=True)
    for epoch in range(n_epochs):
        for idx in shard_batches(dataset.batch_indices(global_batch, True, seed + epoch),
                                 info.rank, info.world_size):
            batch = make_batch([dataset[i] for i in idx], config, w, c, dtype, info.device)
            state, metrics = dp.step(state, batch)   # metrics are global
    if info.rank == 0: save_checkpoint(...)
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from petfunc import tree
from petfunc.train.loss import LossWeights, make_loss
from petfunc.train.step import TrainState, apply_gradients, pack_state, trainable, with_trained


TERMS = ("energy", "forces", "stress")
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
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device 'cuda' requested but torch sees no CUDA device")
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
        except Exception:  # another rank left first: leave too
            pass
    dist.destroy_process_group()


# ---------------------------------------------------------------------------------------
# sharding


def shard_batches(batches: Sequence[Sequence[int]], rank: int, world_size: int) -> list[np.ndarray]:
    """Each rank's share of every global batch of an epoch.

    Global batch ``b`` (indices, e.g. from :meth:`petfunc.data.Dataset.batch_indices`
    with the *global* batch size, same seed on every rank) is split into
    ``world_size`` contiguous parts whose sizes differ by at most one; rank ``r``
    gets part ``r``. Every rank therefore takes the same number of steps. Batches
    with fewer than ``world_size`` structures are dropped (a rank would get none),
    identically on every rank. The union of the shards of a step is exactly the
    global batch, and :class:`DataParallel` makes the step equal to the one-process
    step on that union.
    """
    out = []
    for b in batches:
        b = np.asarray(b)
        if len(b) < world_size:
            continue
        out.append(np.array_split(b, world_size)[rank])
    return out


# ---------------------------------------------------------------------------------------
# the step


def label_counts(batch) -> torch.Tensor:
    """``[3]`` non-NaN label counts (energy, force components, stress components)."""
    return torch.stack(
        [(~torch.isnan(t)).sum() for t in (batch.energy, batch.forces, batch.strain_derivative)]
    ).to(batch.positions.dtype)


def share_factors(local: torch.Tensor, total: torch.Tensor, weights: LossWeights) -> torch.Tensor:
    """``[3]`` factors of the loss terms (energy, forces, stress) on one rank: the
    rank's share ``n_local / N_global`` of the labels for a mean term, 1 for a term
    with ``reduction="sum"`` (the ranks' sums add up to the union's sum), 0 for a
    term with no label anywhere in the union batch."""
    mean_terms = torch.tensor([getattr(weights, t).reduction == "mean" for t in TERMS], device=local.device)
    share = torch.where(total > 0, local / total.clamp_min(1.0), torch.zeros_like(local))
    return torch.where(mean_terms, share, torch.ones_like(local))


def make_scaled_grad_step(
    energy_fn, weights: LossWeights = LossWeights(), autodiff: str = "func", train=None
):
    """``grad_step(params, batch, factors) -> (grads, metrics)`` of
    ``sum_t w_t factors[t] loss_t``: with :func:`share_factors` the sum of the ranks'
    gradients is the gradient of the union batch's loss.

    ``metrics`` holds the local ``*_sse``/``*_sae``/``*_count`` sums, the local shares
    ``factors[t] mean_t`` as ``*_loss`` and ``loss = L_r``: all of them sum over the
    ranks to the union batch's values. ``autodiff``: as for
    :func:`petfunc.train.make_grad_step`.
    """
    from petfunc.train.step import value_and_grad

    loss_fn = make_loss(energy_fn, weights, autodiff)
    term_weights = [getattr(weights, t).weight for t in TERMS]

    def grad_step(params, batch, factors):
        def objective(train_params):
            _, metrics = loss_fn(with_trained(params, train_params, train), batch)
            share = torch.zeros((), dtype=factors.dtype, device=factors.device)
            out = {k: v for k, v in metrics.items() if k != "loss"}
            for i, (term, w) in enumerate(zip(TERMS, term_weights)):
                if f"{term}_loss" in metrics:
                    # this rank's share of the union batch's term (sums to it over ranks)
                    out[f"{term}_loss"] = factors[i] * metrics[f"{term}_loss"]
                    share = share + w * out[f"{term}_loss"]
            out["loss"] = share
            return share, out

        return value_and_grad(objective, trainable(params, train), autodiff)

    return grad_step


class DataParallel:
    """Exact data-parallel training step (see the module docstring).

    Args:
        energy_fn: a :class:`~petfunc.PET` or energy function (as for ``make_loss``).
        optimizer: the torchopt optimizer (identical on all ranks).
        weights: loss terms.
        grad_clip_norm: global gradient norm clip, applied to the reduced gradient.
        compile: compile the gradient step with :func:`petfunc.compile` on the first
            batch (``backend``: ``"inductor"`` or ``"aot_eager"``).
        info: the :class:`DistInfo` (default: :func:`current`). With one process no
            collective is called and the step equals ``make_train_step``'s.
        metrics: ``"global"``: the union batch's metrics on every rank; ``"share"``:
            the same, but ``*_sse``/``*_sae``/``*_count`` divided by the world size,
            so that an epoch-end :func:`all_reduce_metrics` (a SUM) gives the global
            sums; this is the convention of
            :func:`petfunc.trainer.fit`'s ``reduce_metrics`` hook.
        autodiff: ``"func"`` or ``"autograd"`` (see :func:`petfunc.train.make_grad_step`);
            by default ``"func"`` when compiling, ``"autograd"`` (faster eagerly) when not.
        train: which parameters are trained (:func:`petfunc.train.trainable`); the
            optimizer state must be ``optimizer.init(trainable(params, train))``.
        cache_key: with ``compile``, keep the compiled step's trace in the trace
            cache under this key (:func:`petfunc.compile`), so a restart loads it.
        first_step: the number of steps already taken (a resumed run), so that an
            error names the run's step.

    Calling the object, ``dp(params, batch)``, is :meth:`grad_step`: it is a drop-in
    replacement for :func:`petfunc.train.make_grad_step`'s function whose gradient is
    already reduced.
    """

    def __init__(
        self,
        energy_fn,
        optimizer,
        weights: LossWeights = LossWeights(),
        grad_clip_norm=1.0,
        compile: bool = False,
        backend: str = "inductor",
        info: DistInfo | None = None,
        metrics: str = "global",
        autodiff: str | None = None,
        train=None,
        cache_key: str | None = None,
        first_step: int = 0,
    ):
        if metrics not in ("global", "share"):
            raise ValueError(f"metrics must be 'global' or 'share', got {metrics!r}")
        self.metrics = metrics
        self.optimizer = optimizer
        self.weights = weights
        self.grad_clip_norm = grad_clip_norm
        self.info = info or current()
        # compiled steps trace torch.func; eager ones run the faster autograd path
        self.autodiff = autodiff or ("func" if compile else "autograd")
        self.train = train
        self._raw = make_scaled_grad_step(energy_fn, weights, self.autodiff, train)
        self._compile = compile
        self._backend = backend
        self._cache_key = cache_key
        self._fn = None
        # gradient steps taken (by grad_step, which step() calls): names the step in errors
        self.steps = int(first_step)

    @property
    def num_graphs(self) -> int:
        """Compiled graphs so far (AttributeError when not compiling, like an eager step)."""
        if not self._compile:
            raise AttributeError("num_graphs: this DataParallel step is not compiled")
        return getattr(self._fn, "num_graphs", 0)

    def _all_reduce(self, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if not self.info.distributed:
            return tensor
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        except Exception as error:  # gloo/NCCL raise RuntimeError or DistBackendError
            raise _failed(
                self.info, f"all_reduce of the {what} failed in step {self.steps + 1}", error
            ) from error
        return tensor

    def grad_step(self, params, batch):
        """``(grads, metrics)``: the union batch's gradient (identical on every rank)
        and global metrics (``loss``, ``*_loss``, summed ``*_sse``/``*_sae``/``*_count``)."""
        local = label_counts(batch)
        total = self._all_reduce(local.clone(), "label counts")
        factors = share_factors(local, total, self.weights)
        if self._fn is None:
            if self._compile:
                from petfunc.compile import compile as compile_fn

                self._fn = compile_fn(
                    self._raw,
                    params,
                    batch,
                    factors,
                    backend=self._backend,
                    static_argnums=(0, 2),
                    cache_key=self._cache_key,
                )
            else:
                self._fn = self._raw
        grads, metrics = self._fn(params, batch, factors)

        # one flat buffer: gradients then metrics, one collective
        leaves, spec = torch.utils._pytree.tree_flatten(grads)
        keys = sorted(metrics)
        parts = [g.reshape(-1) for g in leaves] + [metrics[k].reshape(1).to(local.dtype) for k in keys]
        buffer = self._all_reduce(torch.cat(parts), "gradients")
        out, offset = [], 0
        for g in leaves:
            out.append(buffer[offset : offset + g.numel()].view_as(g))
            offset += g.numel()
        reduced = {k: buffer[offset + i] for i, k in enumerate(keys)}
        if self.metrics == "share" and self.info.distributed:
            for k in keys:
                if _is_sum(k):
                    reduced[k] = reduced[k] / self.info.world_size
        self.steps += 1
        return torch.utils._pytree.tree_unflatten(out, spec), reduced

    __call__ = grad_step

    def step(self, state: TrainState, batch):
        """``(new_state, metrics)``; metrics as :meth:`grad_step` plus ``grad_norm``."""
        grads, metrics = self.grad_step(state.params, batch)
        state, norm = apply_gradients(self.optimizer, state, grads, self.grad_clip_norm, self.train)
        if norm is not None:
            metrics["grad_norm"] = norm
        return state, metrics


def _is_sum(key: str) -> bool:
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
        raise _failed(info, "all_reduce of the epoch metrics failed", error) from error
    return dict(zip(keys, buffer.cpu().tolist()))


def _failed(info: DistInfo, what: str, error: Exception) -> DistributedError:
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
    from petfunc.trainer.options import changed_options

    described = [None] * info.world_size
    try:
        dist.all_gather_object(described, dict(description))
    except Exception as error:
        raise _failed(info, "comparing the ranks' options failed", error) from error
    differences = []
    for rank in range(1, info.world_size):
        changed = changed_options(described[0], described[rank])
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


def check_identical(params, info: DistInfo | None = None) -> float:
    """Max abs difference of ``params`` between rank 0 and this rank (0.0 with one
    process); a cheap consistency check to run now and then."""
    info = info or current()
    if not info.distributed:
        return 0.0
    flat = torch.cat([t.reshape(-1) for t in tree.flatten(params).values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return float((flat - reference).abs().max())


# ---------------------------------------------------------------------------------------
# checkpoints (rank 0 writes; any world size reads)

CHECKPOINT_FORMAT = "petfunc-dp-state"


def save_checkpoint(
    path, state: TrainState, step: int, extra: dict | None = None, info: DistInfo | None = None
) -> None:
    """Rank 0 writes ``{params, opt_state, step, world_size, extra}`` atomically; all ranks
    then wait at a barrier. The file does not depend on the world size: a run with any
    number of processes resumes it (:func:`load_checkpoint`)."""
    from petfunc.trainer.fit import _atomic_save, state_to_plain

    info = info or current()
    if info.is_main:
        payload = {
            "format": CHECKPOINT_FORMAT,
            "params": {k: v.detach().to("cpu").clone() for k, v in tree.flatten(state.params).items()},
            "opt_state": state_to_plain(state.opt_state),
            "step": int(step),
            "world_size": int(info.world_size),
            "extra": extra or {},
        }
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        _atomic_save(payload, Path(path))
    if info.distributed:
        dist.barrier()


def load_checkpoint(path, optimizer, device=None, train=None):
    """``(TrainState, step, extra)`` from :func:`save_checkpoint`'s file (``train``: the
    selection of trained parameters the state was made with)."""
    from petfunc.trainer.fit import state_from_plain

    payload = torch.load(path, map_location="cpu", weights_only=True)
    if payload.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"{path} is not a {CHECKPOINT_FORMAT} checkpoint")
    params = tree.unflatten(dict(payload["params"]))
    if device is not None:
        params = tree.tree_map(lambda t: t.to(device), params)
    template = optimizer.init(trainable(params, train))
    state = pack_state(TrainState(params, state_from_plain(payload["opt_state"], template)), train)
    return state, int(payload["step"]), payload["extra"]
