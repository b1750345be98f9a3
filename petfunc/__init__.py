"""petfunc: the PET interatomic potential as pure functions in PyTorch (torch.func).

The model
    ``PETConfig`` (metatrain's hypers), ``PET(config)`` with ``init(seed=...)`` (a
    nested dict of tensors whose flattened keys are metatrain's) and
    ``energy(params, positions, cell, neighbors)``; ``from_atoms`` / ``prepare`` +
    ``collate`` build the inputs from ASE structures.
Derivatives (``torch.func``, every position dependence inside)
    ``forces``, ``energy_and_forces``, ``energy_forces_stress``,
    ``energy_forces_strain_derivative``; ``hessian``, ``hvp`` (memory-bounded).
Training
    ``make_loss``, ``LossWeights``, ``make_train_step`` / ``make_grad_step`` with
    ``init_state``, ``make_optimizer``, ``warmup_cosine``; ``compile`` (make_fx +
    torch.compile, one graph for every batch size); ``fit`` (the ``petfunc train``
    trainer); ``distributed`` (data parallel on torch.distributed); ``lora``,
    ``ensemble`` (vmap'd committees), ``hessian_loss``, ``remat``.
Files and tools
    ``save_params`` / ``load_params`` / ``load_model``, ``from_metatrain``
    (checkpoints and exported models), ``llpr`` (metatrain's LLPR uncertainties),
    ``export`` (PT2 artifacts); ``petfunc.ase.PETCalculator``, ``relax``, ``dynamics``.

The README has examples of each; ``petfunc --help`` the command line.
"""

from petfunc import (
    _compat,
    allocator,
    distributed,
    dynamics,
    ensemble,
    export,
    hessian,  # callable: petfunc.hessian(energy_fn) (see petfunc.hessian)
    llpr,
    lora,
    relax,
    tree,
)
from petfunc.compile import compile
from petfunc.config import LongRangeConfig, PETConfig
from petfunc.data.samples import Batch, Dataset, Sample, make_batch, read_dataset
from petfunc.derivatives import (
    cell_volume,
    energy_and_forces,
    energy_forces_strain_derivative,
    energy_forces_stress,
    energy_terms_forces_strain_derivative,
    forces,
)
from petfunc.determinism import deterministic_algorithms
from petfunc.graph.neighbors import Neighbors
from petfunc.hessian import hvp
from petfunc.io.params import from_metatrain, load_params, save_params
from petfunc.model.pet import PET, init
from petfunc.remat import remat
from petfunc.structures import Structure, collate, from_atoms, prepare, prepare_atoms
from petfunc.train import hessian_loss
from petfunc.train.loss import LossTerm, LossWeights, make_loss
from petfunc.train.step import (
    TrainState,
    apply_gradients,
    init_state,
    make_grad_step,
    make_optimizer,
    make_train_step,
    pack_state,
    warmup_cosine,
)
from petfunc.trainer.fit import fit, load_model


__version__ = "0.1.0"

_compat.install()
__getattr__ = _compat.module_getattr
