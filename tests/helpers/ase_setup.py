"""The small random PET and the structures of the ASE calculator tests (tests/ase/).

The model (seed 1) has a stable, relaxed diamond-like 8-atom minimum."""

import ase
import ase.build
import numpy as np
import pytest
import torch

import petfunc


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)
CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
COMPOSITION = [-13.6, -1029.8, -1485.3, -2042.6]  # roughly eV per H, C, N, O


def make_params(config=CONFIG, seed=1):
    """float64 parameters of ``config`` with the composition COMPOSITION."""
    params = petfunc.init(config, seed=seed, dtype=torch.float64)
    params["composition_weights"] = torch.tensor(COMPOSITION, dtype=torch.float64)
    return params


def committee(n=3):
    """The parameters of ``n`` other models (seeds 2, 3, ...)."""
    return [make_params(seed=seed) for seed in range(2, 2 + n)]


# ---------------------------------------------------------------------------------------
# structures


def ethanol():
    """Ethanol, rattled."""
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=1)
    return atoms


def carbon_cell():
    """8-atom cubic diamond cell with two N, rattled."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.symbols[[1, 6]] = "N"
    atoms.rattle(0.08, seed=4)
    return atoms


def triclinic_cell():
    """A small, skewed cell (lattice vectors shorter than the cutoff)."""
    atoms = ase.Atoms(
        "CCOH",
        positions=[[0.1, 0.0, 0.2], [1.4, 0.9, 0.3], [0.6, 1.7, 1.2], [1.9, 0.3, 1.6]],
        cell=[[2.9, 0.1, 0.0], [0.6, 2.8, 0.2], [0.3, -0.4, 3.1]],
        pbc=True,
    )
    return atoms


def slab():
    """pbc (T, T, F) with 8 Å of vacuum in the (non-periodic) third cell row."""
    atoms = ase.Atoms(
        "CCOCH",
        positions=[[0.0, 0.0, 0.0], [1.3, 1.2, 0.1], [0.1, 1.4, 1.3], [1.5, 0.2, 1.4], [0.8, 0.7, 2.5]],
        cell=[[2.6, 0.0, 0.0], [0.4, 2.7, 0.0], [0.0, 0.0, 10.0]],
        pbc=[True, True, False],
    )
    atoms.rattle(0.03, seed=5)
    return atoms


def relative(a, b):
    """max |a - b| / max |b|, in float64."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-300))


def metatomic_calculator(config, params):
    """metatomic's ASE calculator on metatrain's exported PET with ``params``; skips the
    test where metatrain or metatomic_ase is not installed."""
    pytest.importorskip("metatrain")
    metatomic_ase = pytest.importorskip("metatomic_ase")
    from tests.helpers import mtt_reference as ref

    model = ref.make_model(config)
    ref.load_params(model, params)
    return metatomic_ase.MetatomicCalculator(model.export(), device="cpu")
