"""Training as pure functions: the loss, optimizers, and steps ``state, metrics = step(state, batch)``.

- :mod:`petfunc.train.loss`: metatrain's loss (energy, forces, stress; mse/mae/huber).
- :mod:`petfunc.train.state`: :class:`TrainState`, which parameters train, and
  :func:`partition` / :func:`combine` (trained and frozen parts of a tree).
- :mod:`petfunc.train.optim`: Adam(W) (:func:`adamw` with a weight-decay mask), the
  learning-rate schedule, gradient clipping.
- :mod:`petfunc.train.step`: the train and gradient steps (a grad of a grad).
- :mod:`petfunc.train.hessian_loss`: a loss on Hessian-vector products.
"""

from petfunc.train.loss import LossTerm as LossTerm
from petfunc.train.loss import LossWeights as LossWeights
from petfunc.train.loss import atoms_per_structure as atoms_per_structure
from petfunc.train.loss import make_loss as make_loss
from petfunc.train.optim import AdamState as AdamState
from petfunc.train.optim import adam as adam
from petfunc.train.optim import adamw as adamw
from petfunc.train.optim import apply_updates as apply_updates
from petfunc.train.optim import clip_by_global_norm as clip_by_global_norm
from petfunc.train.optim import make_optimizer as make_optimizer
from petfunc.train.optim import warmup_cosine as warmup_cosine
from petfunc.train.optim import weight_matrices as weight_matrices
from petfunc.train.state import FROZEN as FROZEN
from petfunc.train.state import HEADS as HEADS
from petfunc.train.state import TrainState as TrainState
from petfunc.train.state import combine as combine
from petfunc.train.state import init_state as init_state
from petfunc.train.state import pack_params as pack_params
from petfunc.train.state import pack_state as pack_state
from petfunc.train.state import partition as partition
from petfunc.train.state import trainable as trainable
from petfunc.train.state import with_trained as with_trained
from petfunc.train.step import apply_gradients as apply_gradients
from petfunc.train.step import grad_step_of as grad_step_of
from petfunc.train.step import make_grad_step as make_grad_step
from petfunc.train.step import make_train_step as make_train_step
from petfunc.train.step import train_step_of as train_step_of
from petfunc.train.step import value_and_grad as value_and_grad
