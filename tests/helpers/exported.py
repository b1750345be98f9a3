"""The small PET (adaptive cutoff) and structures shared by the export tests."""

import ase
import ase.build
import torch

import petfunc
from petfunc.data import padding_sample
from petfunc.structures import collate, prepare_atoms


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


# adaptive cutoff on: its radii depend on positions, so forces and stress need their terms
CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 8), num_neighbors_adaptive=12, **SMALL)


def make_params(seed=3):
    """float64 parameters of CONFIG with a composition and an energy scale."""
    params = petfunc.init(CONFIG, seed=seed, dtype=torch.float64)
    params["composition_weights"] = torch.tensor([-13.6, -1029.8, -2042.6], dtype=torch.float64)
    params["energy_scale"] = torch.tensor(1.7, dtype=torch.float64)
    return params


def structures():
    """Two diamond cells of other sizes and methanol, rattled."""
    diamond = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    diamond.symbols[[2, 5]] = "O"
    diamond.rattle(0.08, seed=1)
    larger = ase.build.bulk("C", "diamond", a=3.6, cubic=True).repeat((2, 1, 1))
    larger.rattle(0.1, seed=2)
    methanol = ase.build.molecule("CH3OH")
    methanol.rattle(0.03, seed=3)
    return [diamond, larger, methanol]


def reference(params, atoms):
    """``(inputs, eager outputs)`` of ``atoms`` with the padding molecule."""
    inputs = collate(
        [prepare_atoms(atoms, CONFIG), padding_sample(CONFIG).structure], CONFIG, dtype=torch.float64
    )
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(CONFIG).energy_terms)
    return inputs, fn(params, *inputs)
