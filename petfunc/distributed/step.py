"""The data-parallel step: each rank's share of the union batch's loss, one
``all_reduce`` of the gradients, and the same optimizer update on every rank (see
:mod:`petfunc.distributed` for why this is exact)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from petfunc.compile import compile as compile_function
from petfunc.distributed.process import DistInfo, collective_failed, current, is_sum
from petfunc.train import (
    LossWeights,
    TrainState,
    apply_gradients,
    make_loss,
    trainable,
    value_and_grad,
    with_trained,
)


TERMS = ("energy", "forces", "stress")


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
        grad_clip_norm: global gradient norm clip, applied to the reduced gradient
            (``None``, the default: no clipping; ``petfunc train`` passes its own).
        compile: compile the gradient step with :func:`petfunc.compile` on the first
            batch (``backend``: ``"inductor"`` or ``"aot_eager"``).
        info: the :class:`DistInfo` (default: :func:`current`). With one process no
            collective is called and the step equals ``make_train_step``'s.
        metrics: ``"global"``: the union batch's metrics on every rank; ``"share"``:
            the same, but ``*_sse``/``*_sae``/``*_count`` divided by the world size,
            so that an epoch-end :func:`all_reduce_metrics` (a SUM) gives the global
            sums; this is the convention of
            :func:`petfunc.trainer.training`'s ``reduce_metrics`` hook.
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
        grad_clip_norm: float | None = None,
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
            raise collective_failed(
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
                self._fn = compile_function(
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
                if is_sum(k):
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
