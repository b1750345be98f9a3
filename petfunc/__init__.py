"""petfunc: the PET interatomic potential as pure functions in PyTorch (torch.func)."""

from . import allocator, tree
from .config import LongRangeConfig, PETConfig
from .derivatives import (
    cell_volume,
    energy_and_forces,
    energy_forces_strain_derivative,
    energy_forces_stress,
    energy_terms_forces_strain_derivative,
    forces,
)
from .io import from_metatrain, load_params, save_params
from .model import PET, init
from .neighbors import Neighbors
from .structures import Structure, collate, from_atoms, prepare, prepare_atoms
from .compile import compile
from .determinism import deterministic_algorithms
from .data import Batch, Dataset, Sample, make_batch, read_dataset
from .loss import LossTerm, LossWeights, make_loss
from .train import (
    TrainState,
    apply_gradients,
    init_state,
    make_grad_step,
    make_optimizer,
    make_train_step,
    pack_state,
    warmup_cosine,
)
from .trainer import fit, load_model
from . import dynamics, ensemble, export, hessian_loss, llpr, lora, relax
from . import hessian  # callable: petfunc.hessian(energy_fn) (see petfunc.hessian)
from .hessian import hvp
from . import remat  # callable: petfunc.remat(fn) (see petfunc.remat)


__version__ = "0.1.0"
