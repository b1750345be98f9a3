"""Data-parallel training on ``torch.distributed`` (gloo or NCCL), exact to round-off:
every rank differentiates its shard's share of the union batch's loss, one
``all_reduce`` sums the gradients, and every rank applies the same update."""

from petfunc.distributed.process import DEFAULT_TIMEOUT_S as DEFAULT_TIMEOUT_S
from petfunc.distributed.process import DataParallel as DataParallel
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
from petfunc.distributed.process import label_counts as label_counts
from petfunc.distributed.process import make_scaled_grad_step as make_scaled_grad_step
from petfunc.distributed.process import shard_batches as shard_batches
from petfunc.distributed.process import share_factors as share_factors
from petfunc.distributed.process import shutdown as shutdown
