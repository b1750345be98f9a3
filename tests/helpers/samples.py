"""Labelled samples shared by tests in several folders."""

import ase
from ase.build import bulk

from petfunc.data import sample_from_atoms


def zbl_training_samples(config):
    """Four compressed Cu/Al fcc cells, unlabelled: ZBL acts on their nearest neighbours."""
    samples = []
    for k in range(4):
        atoms = bulk("Cu", "fcc", a=3.3, cubic=True)  # nearest neighbours 2.33 A < r_c 2.42-2.64 A
        atoms.numbers[: k + 1] = 13  # 1 to 4 Al atoms: compositions not collinear
        atoms.rattle(0.1, seed=k)
        samples.append(sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None))
    return samples


def slab():
    """A C2OH slab, periodic in-plane only (pbc T, T, F), of a 2.6 x 2.7 Å oblique cell."""
    return ase.Atoms(
        "CCOH",
        positions=[[0, 0, 0], [1.3, 1.2, 0.1], [0.1, 1.4, 1.3], [1.5, 0.2, 2.4]],
        cell=[[2.6, 0, 0], [0.4, 2.7, 0], [0, 0, 0]],
        pbc=[True, True, False],
    )
