"""petfunc against metatrain's eager PET for random architectures (any combination
of metatrain's switches) on random batches of molecules, cells, slabs and wires, and
on atoms outside their cells (float64, 1e-10 relative)."""

import ase
import ase.build
import numpy as np
import pytest


pytest.importorskip("metatrain")


from tests.helpers import mtt_reference as ref
from tests.helpers.parity import (
    compare_energies_forces_strain,
    conditioned,
    random_config,
    random_params,
    random_structure,
)


@pytest.mark.parametrize("seed", range(16))
def test_random_architecture_on_random_structures(seed):
    """Energies, per-atom energies, forces and strain derivatives to 1e-10 relative
    (absolute floor 1e-13: symmetric cells have zero forces) for a random switch
    combination on a random batch of molecules, bulk, slabs and wires."""
    import random

    rng = random.Random(seed)
    config = random_config(rng)
    batch = [random_structure(rng, config.atomic_types) for _ in range(rng.randint(1, 4))]
    if seed % 3 == 0:
        config, batch = conditioned(config, batch, random.Random(1000 + seed))
    params = random_params(config, seed=seed)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare_energies_forces_strain(config, params, mtt, batch, what=f"{config}: ")


@pytest.mark.parametrize("seed", range(3))
def test_atoms_outside_their_cell(seed):
    """Unwrapped positions, as MD trajectories have them: atoms moved by whole
    lattice vectors (up to 3 each way) out of triclinic cells, periodic in 3 or 2
    directions, against metatrain."""
    import random

    from ase.geometry import get_distances

    rng = random.Random(500 + seed)
    gen = np.random.default_rng(seed)
    config = random_config(rng)
    frames = []
    while len(frames) < 3:
        n = rng.randint(2, 6)
        slab = len(frames) == 1
        cell = np.diag(gen.uniform(3.0, 6.0, 3)) + gen.uniform(-1.0, 1.0, (3, 3))
        atoms = ase.Atoms(
            numbers=[rng.choice(config.atomic_types) for _ in range(n)],
            scaled_positions=gen.uniform(0, 1, (n, 3)),
            cell=cell,
            pbc=[True, True, not slab],
        )
        if (
            get_distances(atoms.positions, cell=atoms.cell, pbc=atoms.pbc)[1][~np.eye(n, dtype=bool)].min()
            < 0.7
        ):
            continue
        shifts = gen.integers(-3, 4, (n, 3)).astype(float)
        if slab:
            shifts[:, 2] = 0.0  # no images along the open direction
        atoms.positions = atoms.positions + shifts @ atoms.cell.array
        assert np.abs(atoms.get_scaled_positions(wrap=False)).max() > 1.0
        frames.append(atoms)
    params = random_params(config, seed=seed)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare_energies_forces_strain(config, params, mtt, frames, what=f"{config}: ")
