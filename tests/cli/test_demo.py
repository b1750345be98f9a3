"""The demo run's dataset and options."""

import ase.io
import numpy as np

from petfunc.cli import DEMO_OPTIONS, DEMO_STRUCTURES, make_default_dataset
from petfunc.trainer.options import resolve_options


def test_demo_dataset_and_options(tmp_path):
    """Fcc Cu/Al/Ni cells of 8, 16, 32 and 12 atoms with EMT labels, the same for the
    same seed; the demo's options train on it with 10 % validation."""
    path = make_default_dataset(tmp_path / "demo.xyz", n_structures=8, seed=4)
    frames = ase.io.read(path, ":")
    assert [len(a) for a in frames] == [8, 16, 32, 12] * 2
    assert {s for a in frames for s in a.get_chemical_symbols()} <= {"Cu", "Al", "Ni"}
    for atoms in frames:
        assert np.isfinite(atoms.get_potential_energy())
        assert atoms.get_forces().shape == (len(atoms), 3) and atoms.get_stress().shape == (6,)
    again = ase.io.read(make_default_dataset(tmp_path / "again.xyz", n_structures=8, seed=4), ":")
    assert all(np.array_equal(a.positions, b.positions) for a, b in zip(frames, again))
    assert DEMO_STRUCTURES == 160
    options = resolve_options({**DEMO_OPTIONS, "training_set": str(path)})
    assert options["validation_set"] == 0.1 and options["architecture"]["model"]["d_pet"] == 32
