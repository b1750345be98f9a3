"""petfunc: the PET interatomic potential as pure functions in PyTorch (torch.func)."""

from . import tree
from .config import LongRangeConfig, PETConfig
from .derivatives import (
    cell_volume,
    energy_and_forces,
    energy_forces_strain_derivative,
    energy_forces_stress,
    forces,
)
from .model import PET, init
from .neighbors import Neighbors
from .structures import Structure, collate, from_atoms, prepare, prepare_atoms


__version__ = "0.1.0"
