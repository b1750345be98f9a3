"""The demo run of ``petfunc train`` (no options file): its options and its built-in
dataset of EMT-labelled Cu/Al/Ni alloys, written to the run's folder."""

from __future__ import annotations

from pathlib import Path

import ase.build
import ase.io
import numpy as np
from ase.calculators.emt import EMT
from ase.calculators.singlepoint import SinglePointCalculator


#: the demo run's options (``petfunc train`` without an options file); the training
#: set is the built-in dataset written to the output folder.
DEMO_OPTIONS = {
    "seed": 0,
    "base_precision": 32,
    "device": "auto",
    "architecture": {
        "name": "pet",
        "model": {
            "cutoff": 4.5,
            "cutoff_width": 0.5,
            "d_pet": 32,
            "d_head": 32,
            "d_node": 64,
            "d_feedforward": 64,
            "num_heads": 4,
            "num_attention_layers": 1,
            "num_gnn_layers": 2,
        },
        "training": {
            "batch_size": 8,
            "num_epochs": 20,
            "learning_rate": 3e-3,
            "warmup_fraction": 0.01,
        },
    },
    "validation_set": 0.1,
}

DEMO_STRUCTURES = 160


def make_default_dataset(path, n_structures: int = DEMO_STRUCTURES, seed: int = 0) -> Path:
    """Write the built-in demo dataset to ``path`` (extxyz) and return the path.

    Random fcc Cu/Al/Ni alloys (50/25/25 %) in cubic cells repeated 1x1x2, 1x1x3,
    1x2x2 and 2x2x2 (8, 12, 16, 32 atoms), lattice constant by Vegard's law, a random
    symmetric strain of 2 % and Gaussian rattling of 0.1 Å; energy, forces and stress
    from ASE's EMT calculator. About 2 s for 160 structures.
    """
    rng = np.random.default_rng(seed)
    lattice = {"Cu": 3.61, "Al": 4.05, "Ni": 3.52}
    repeats = [(1, 1, 2), (1, 2, 2), (2, 2, 2), (1, 1, 3)]
    frames = []
    for i in range(int(n_structures)):
        atoms = ase.build.bulk("Cu", "fcc", a=1.0, cubic=True).repeat(repeats[i % len(repeats)])
        symbols = rng.choice(["Cu", "Al", "Ni"], size=len(atoms), p=[0.5, 0.25, 0.25])
        atoms.set_chemical_symbols(list(symbols))
        a = float(np.mean([lattice[s] for s in symbols]))
        strain = np.eye(3) + rng.normal(0.0, 0.02, (3, 3))
        strain = 0.5 * (strain + strain.T)
        atoms.set_cell(np.asarray(atoms.cell) * a @ strain, scale_atoms=True)
        atoms.positions += rng.normal(0.0, 0.1, atoms.positions.shape)
        atoms.calc = EMT()
        energy = atoms.get_potential_energy()
        forces = atoms.get_forces()
        stress = atoms.get_stress()
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces, stress=stress)
        frames.append(atoms)
    path = Path(path)
    ase.io.write(str(path), frames, format="extxyz")
    return path
