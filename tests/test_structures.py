"""Structures as PET's inputs (petfunc.structures): the charge and spin read from
``atoms.info``, the values refused, and the model's frame that ``collate`` builds."""

import ase.build
import numpy as np
import pytest
import torch

import petfunc
from petfunc.derivatives import energy_and_forces


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


def _ethanol():
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=1)
    return atoms


def test_system_conditioning_input_errors():
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 7, 8), system_conditioning=True, max_charge=2, max_spin_multiplicity=3, **SMALL
    )
    cases = [
        ({"charge": 3}, r"structure 0: charge 3 is outside the model's range \[-2, 2\] \(max_charge\)"),
        ({"charge": 0.5}, "structure 0: charge must be an integer, got 0.5"),
        ({"spin_multiplicity": 0}, r"spin multiplicity 0 is outside the model's range \[1, 3\]"),
        ({"spin": 4}, r"spin multiplicity 4 is outside the model's range \[1, 3\]"),
        ({"charge": "one"}, "charge must be one integer, got 'one'"),
    ]
    for info, message in cases:
        atoms = _ethanol()
        atoms.info.update(info)
        with pytest.raises(ValueError, match=message):
            petfunc.from_atoms([atoms], config)
    # a float that is an integer is fine, as in metatrain; an unconditioned model ignores both
    atoms = _ethanol()
    atoms.info.update(charge=-2.0, spin=3.0)
    assert petfunc.from_atoms([atoms], config)[2].charge.tolist() == [-2]
    atoms.info.update(charge=0.5)
    plain = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    assert petfunc.from_atoms([atoms], plain)[2].charge.tolist() == [0]


# ---------------------------------------------------------------------------------------
# the model's frame


def test_collate_moves_far_structures_close_to_the_origin():
    """``from_atoms`` gives positions translated in float64 close to the origin, with
    cell shifts that match them; the stored structure keeps the positions given."""
    config = petfunc.PETConfig(atomic_types=(1, 6, 8), **SMALL)
    near = _ethanol()
    far = near.copy()
    far.positions += [1e6, -2e6, 5e5]
    crystal = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    crystal.rattle(0.05, seed=2)
    diffused = crystal.copy()
    diffused.positions += np.arange(24).reshape(8, 3) * 1000 @ crystal.cell.array
    frames = [far, diffused]
    structures = [petfunc.prepare_atoms(a, config) for a in frames]
    for structure, atoms in zip(structures, frames):
        assert np.array_equal(structure.positions, atoms.positions)
    positions, cell, neighbors = petfunc.collate(structures, config, dtype=torch.float64)
    assert positions.abs().max() < 3 * 3.57 * 3
    # the same structures: the same energies and forces (float64 round-off)
    efs = energy_and_forces(petfunc.PET(config).energy, "autograd")
    params = petfunc.init(config, seed=0, dtype=torch.float64)
    energy, forces = efs(params, positions, cell, neighbors)
    energy_ref, forces_ref = efs(params, *petfunc.from_atoms([near, crystal], config, dtype=torch.float64))
    torch.testing.assert_close(energy, energy_ref, rtol=1e-12, atol=0)
    torch.testing.assert_close(forces, forces_ref, rtol=0, atol=1e-9)


def test_collate_counts_its_replacements():
    config = petfunc.PETConfig(atomic_types=(1, 6, 8), **SMALL)
    structure = petfunc.prepare_atoms(_ethanol(), config)
    with pytest.raises(ValueError, match="collate: 2 positions and 1 cells for 1 structures"):
        petfunc.collate([structure], config, positions=[structure.positions] * 2)
