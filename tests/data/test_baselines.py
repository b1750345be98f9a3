"""The composition weights and energy scale fitted to a dataset (petfunc.data's
baselines)."""

import numpy as np
import pytest

import petfunc
from petfunc.data import Dataset, zbl_baseline
from tests.helpers.samples import zbl_training_samples


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


def test_composition_fit_excludes_zbl():
    """Energies = sum of per-species offsets + ZBL: the fit recovers the offsets."""
    config = petfunc.PETConfig(atomic_types=(13, 29), zbl=True, **SMALL)
    samples = zbl_training_samples(config)
    offsets = np.array([-3.25, -4.5])
    for s in samples:
        s.energy = float(offsets[s.structure.species].sum() + zbl_baseline(s, config)[0])
    with pytest.warns(UserWarning, match="reproduce the .* training energies to round-off"):
        w, c = Dataset(samples, config).fit_composition_and_scale()
    np.testing.assert_allclose(w, offsets, rtol=1e-10)
    assert c == 1.0  # nothing left but round-off: no scale of that (petfunc.data.fit_scale)
