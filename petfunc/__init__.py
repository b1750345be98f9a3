"""petfunc: the PET interatomic potential as pure functions in PyTorch (torch.func).

The model
    ``PETConfig`` (metatrain's hypers), ``PET(config)`` with ``init(seed=...)`` (a
    nested dict of tensors whose flattened keys are metatrain's) and
    ``energy(params, positions, cell, neighbors)``; ``check_params(config, params)``
    names what in a parameter tree does not fit its config; ``from_atoms`` / ``prepare`` +
    ``collate`` build the inputs from ASE structures.
Derivatives (``torch.func``, every position dependence inside)
    ``forces``, ``energy_and_forces``, ``energy_forces_stress``,
    ``energy_forces_strain_derivative``; ``hessian``, ``hvp`` (memory-bounded).
Training
    ``make_loss``, ``LossWeights``, ``make_train_step`` / ``make_grad_step`` (PET's
    loss or any ``loss_fn``) with ``init_state``, ``make_optimizer``, ``adamw`` (a
    weight-decay mask), ``warmup_cosine``; ``partition`` / ``combine`` (trained and
    frozen parameters); ``tree`` (``ravel_pytree``, ``tree_map``, ``tree_vdot``,
    ``tree_add``, ``tree_scale``); ``compile`` (make_fx +
    torch.compile, one graph for every batch size); ``fit`` (the ``petfunc train``
    trainer); ``distributed`` (data parallel on torch.distributed); ``lora``,
    ``ensemble`` (vmap'd committees), ``hessian_loss``, ``remat``.
Files and tools
    ``save_params`` / ``load_params`` / ``load_model``, ``from_metatrain``
    (checkpoints and exported models), ``llpr`` (metatrain's LLPR uncertainties),
    ``export`` (PT2 artifacts); ``petfunc.ase.PETCalculator``, ``relax``, ``dynamics``.

The subpackages, from the bottom layer up: ``ops`` and ``compile`` (kernels and
tracing, knowing nothing of PET), ``graph`` (the eager neighbour graph), ``model``,
``data`` and ``io``, ``train``, the tools (``ensemble``, ``llpr``, ``distributed``,
``export``, ``ase``, ``relax``, ``dynamics``), ``trainer`` (the ``petfunc train``
application) and ``cli``. The README has examples of each; ``petfunc --help`` the
command line.
"""

from petfunc import _compat
from petfunc import allocator as allocator
from petfunc import distributed as distributed
from petfunc import dynamics as dynamics
from petfunc import ensemble as ensemble
from petfunc import export as export
from petfunc import llpr as llpr
from petfunc import lora as lora
from petfunc import relax as relax
from petfunc import tree as tree
from petfunc._version import __version__ as __version__
from petfunc.config import LongRangeConfig as LongRangeConfig
from petfunc.config import PETConfig as PETConfig
from petfunc.data import Batch as Batch
from petfunc.data import Dataset as Dataset
from petfunc.data import Sample as Sample
from petfunc.data import make_batch as make_batch
from petfunc.data import read_dataset as read_dataset
from petfunc.derivatives import cell_volume as cell_volume
from petfunc.derivatives import energy_and_forces as energy_and_forces
from petfunc.derivatives import energy_forces_strain_derivative as energy_forces_strain_derivative
from petfunc.derivatives import energy_forces_stress as energy_forces_stress
from petfunc.derivatives import energy_terms_forces_strain_derivative as energy_terms_forces_strain_derivative
from petfunc.derivatives import forces as forces
from petfunc.determinism import deterministic_algorithms as deterministic_algorithms
from petfunc.graph import Neighbors as Neighbors
from petfunc.io import from_metatrain as from_metatrain
from petfunc.io import load_model as load_model
from petfunc.io import load_params as load_params
from petfunc.io import save_params as save_params
from petfunc.model import PET as PET
from petfunc.model import check_params as check_params
from petfunc.model import init as init
from petfunc.structures import Structure as Structure
from petfunc.structures import collate as collate
from petfunc.structures import from_atoms as from_atoms
from petfunc.structures import prepare as prepare
from petfunc.structures import prepare_atoms as prepare_atoms
from petfunc.train import LossTerm as LossTerm
from petfunc.train import LossWeights as LossWeights
from petfunc.train import TrainState as TrainState
from petfunc.train import adamw as adamw
from petfunc.train import apply_gradients as apply_gradients
from petfunc.train import combine as combine
from petfunc.train import hessian_loss as hessian_loss
from petfunc.train import init_state as init_state
from petfunc.train import make_grad_step as make_grad_step
from petfunc.train import make_loss as make_loss
from petfunc.train import make_optimizer as make_optimizer
from petfunc.train import make_train_step as make_train_step
from petfunc.train import pack_state as pack_state
from petfunc.train import partition as partition
from petfunc.train import warmup_cosine as warmup_cosine
from petfunc.trainer import fit as fit


# isort: split
# Functions named like their modules: ``petfunc.compile(fn, ...)``,
# ``petfunc.hessian(energy_fn)`` and ``petfunc.remat(fn)`` are the functions; the
# modules' other names import from them (``from petfunc.hessian import hvp``).
# Bound last, after every import that could load those modules.
from petfunc.compile import compile as compile
from petfunc.hessian import hessian as hessian
from petfunc.hessian import hvp as hvp
from petfunc.remat import remat as remat


_compat.install()
__getattr__ = _compat.module_getattr
