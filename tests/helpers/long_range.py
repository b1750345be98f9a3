"""The long-range (Coulomb) PETs and structures shared by the long-range tests of
several folders (tests/model/, tests/graph/, tests/ase/, tests/export/)."""

import ase
import ase.build
import torch

import petfunc


SMALL = dict(d_pet=16, d_node=24, d_head=8, d_feedforward=16, num_heads=2)
TYPES = (1, 6, 8)


def lr_config(**lr):
    """A long-range PET config: the long-range settings among ``lr`` go to
    ``long_range``, the others to the PET."""
    extra = {
        k: lr.pop(k) for k in list(lr) if k not in ("smearing", "kspace_resolution", "interpolation_nodes")
    }
    return petfunc.PETConfig(atomic_types=TYPES, long_range=dict(enable=True, **lr), **SMALL, **extra)


def perturbed_params(config, seed=3):
    """Random weights (float64) with a non-trivial composition and scale."""
    params = petfunc.PET(config).init(seed=seed, dtype=torch.float64)
    g = torch.Generator().manual_seed(seed + 1)
    flat = petfunc.tree.flatten(params)
    for k, v in flat.items():
        if k not in ("composition_weights", "energy_scale"):
            flat[k] = v + 0.3 * torch.randn(v.shape, generator=g, dtype=v.dtype)
    flat["composition_weights"] = torch.tensor([-1.5, -4.0, -3.0], dtype=torch.float64)
    flat["energy_scale"] = torch.tensor(0.7, dtype=torch.float64)
    return petfunc.tree.unflatten(flat)


def molecule():
    """Ethanol, rattled."""
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=2)
    return atoms


def diamond():
    """The 8-atom cubic diamond cell, rattled."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.rattle(0.1, seed=1)
    return atoms


def triclinic():
    """A 3-atom triclinic cell."""
    cell = [[4.2, 0.1, 0.3], [0.8, 4.6, 0.0], [0.2, 0.5, 5.1]]
    return ase.Atoms("CHO", positions=[[0, 0, 0], [1.1, 0.3, 0.2], [0.5, 1.4, 0.9]], cell=cell, pbc=True)


def relative(a, b):
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-300))
