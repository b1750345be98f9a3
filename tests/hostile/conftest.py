"""The structure file the hostile-input tests train and evaluate on."""

import pytest

from petfunc.cli import make_default_dataset


@pytest.fixture(scope="package")
def dataset(tmp_path_factory):
    """8 EMT structures with energies, forces and stresses."""
    return make_default_dataset(tmp_path_factory.mktemp("data") / "emt.xyz", n_structures=8, seed=2)
