"""The model of the ASE calculator tests (tests/helpers/ase_setup.py)."""

import pytest

from tests.helpers.ase_setup import make_params


@pytest.fixture(scope="module")
def params():
    """The float64 parameters of the calculator tests' model (seed 1)."""
    return make_params()
