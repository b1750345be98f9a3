"""Labelled samples shared by tests in several folders."""

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
