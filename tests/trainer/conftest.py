"""The dataset the trainer's tests train on."""

import pytest

from petfunc.cli import make_default_dataset


@pytest.fixture(scope="package")
def dataset(tmp_path_factory):
    """16 EMT structures of 8, 16, 32 and 12 atoms: energies, forces, stresses."""
    return make_default_dataset(tmp_path_factory.mktemp("data") / "emt.xyz", n_structures=16, seed=1)
