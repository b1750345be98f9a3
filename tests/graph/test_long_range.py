"""The eager long-range inputs (petfunc.graph.long_range): the Ewald k-grid and P3M
mesh sizes, and the structures and methods they refuse."""

import numpy as np
import pytest
import torch

import petfunc
from petfunc.graph import long_range as graph_long_range
from tests.helpers.long_range import SMALL, TYPES, lr_config, molecule, perturbed_params, triclinic


def test_input_errors():
    config = lr_config()
    slab = triclinic()
    slab.pbc = [True, True, False]
    with pytest.raises(
        ValueError, match=r"periodic along all three directions or none, got pbc=\[True, True, False\]"
    ):
        petfunc.from_atoms([slab], config)
    with pytest.raises(
        ValueError, match=r"structure 1: long-range features need .* got pbc=\[True, False, False\]"
    ):
        wire = triclinic()
        wire.pbc = [True, False, False]
        petfunc.from_atoms([molecule(), wire], config)
    plain = petfunc.from_atoms(
        [triclinic()], petfunc.PETConfig(atomic_types=TYPES, **SMALL), dtype=torch.float64
    )
    with pytest.raises(ValueError, match="carry no long-range inputs"):
        petfunc.PET(config).energy(perturbed_params(config), *plain)
    with pytest.raises(ValueError, match="long-range method must be one of"):
        petfunc.from_atoms([triclinic()], config, long_range="pme")
    from petfunc.export.package import export

    with pytest.raises(ValueError, match="long_range must be one of"):
        export(config, perturbed_params(config), "model.pt2", long_range="pme")


def test_ewald_grid_and_p3m_mesh_follow_torch_pme():
    """The k-grid and mesh sizes: ceil(|a| / lambda) FFT frequencies per axis, and the
    power of two at or above 2 |a| / h + 1."""
    cell = np.diag([4.0, 5.3, 2.5])
    grid = graph_long_range.ewald_kgrid(cell, 1.33)
    assert grid.shape == (4 * 4 * 2, 3)
    assert sorted(set(grid[:, 0])) == [-2, -1, 0, 1] and sorted(set(grid[:, 2])) == [-1, 0]
    assert graph_long_range.p3m_mesh_sizes(cell, 1.33).tolist() == [8, 16, 8]
