"""Structures as PET's inputs (petfunc.structures): the charge and spin read from
``atoms.info``, and the values refused."""

import ase.build
import pytest

import petfunc


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
