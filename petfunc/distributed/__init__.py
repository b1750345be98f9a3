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

Only rank 0 writes files (``petfunc train`` writes its checkpoints there, with
:func:`petfunc.io.write_checkpoint`; a checkpoint does not depend on the number of
processes, so a run with any number of them restarts from it).

Typical use (``torchrun --nproc_per_node=2 script.py``)::

    info = init_from_env()
    dp = DataParallel(model, optimizer, weights, grad_clip_norm=1.0, compile=True)
    for epoch in range(n_epochs):
        for idx in shard_batches(dataset.batch_indices(global_batch, True, seed + epoch),
                                 info.rank, info.world_size):
            batch = make_batch([dataset[i] for i in idx], config, w, c, dtype, info.device)
            state, metrics = dp.step(state, batch)   # metrics are global
    if info.rank == 0: petfunc.io.write_checkpoint(...)
"""

from petfunc.distributed.process import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from petfunc.distributed.process import DistInfo as DistInfo
from petfunc.distributed.process import DistributedError as DistributedError
from petfunc.distributed.process import RunMismatchError as RunMismatchError
from petfunc.distributed.process import all_reduce_metrics as all_reduce_metrics
from petfunc.distributed.process import all_reduce_sums as all_reduce_sums
from petfunc.distributed.process import barrier as barrier
from petfunc.distributed.process import broadcast_object as broadcast_object
from petfunc.distributed.process import check_same_run as check_same_run
from petfunc.distributed.process import current as current
from petfunc.distributed.process import init_from_env as init_from_env
from petfunc.distributed.process import shutdown as shutdown
from petfunc.distributed.slurm import first_host as first_host
from petfunc.distributed.slurm import in_slurm_job as in_slurm_job
from petfunc.distributed.slurm import slurm_distributed as slurm_distributed
from petfunc.distributed.slurm import slurm_environment as slurm_environment
from petfunc.distributed.step import DataParallel as DataParallel
from petfunc.distributed.step import label_counts as label_counts
from petfunc.distributed.step import make_scaled_grad_step as make_scaled_grad_step
from petfunc.distributed.step import shard_batches as shard_batches
from petfunc.distributed.step import share_factors as share_factors
