"""Shared test setup.

Tests run with one torch thread: the tensors are small, and on a machine shared with
other processes more threads fight them and make tests many times slower.

Compiled traces and the record of exported artifacts are kept in folders of this
test run, not in the user's cache: a test run neither reads what an earlier run left
(which would hide the cost and the failures of tracing, or trust an artifact the run
did not export) nor leaves its own behind. (The fixtures of the
whole run are scoped to the package ``tests``, which holds every test.)

The fixtures ``dataset`` and ``fitted`` serve the training-step tests of several
folders (tests/train/, tests/gpu/, tests/ops/).
"""

import os

import pytest
import torch

from tests.helpers import training


@pytest.fixture(autouse=True, scope="package")
def _caches_of_the_run(tmp_path_factory):
    names = ("PETFUNC_TRACE_CACHE_DIR", "PETFUNC_CACHE_DIR")
    before = {name: os.environ.get(name) for name in names}
    for name in names:
        os.environ[name] = str(tmp_path_factory.mktemp(name.lower()))
    yield
    for name, value in before.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


@pytest.fixture(autouse=True, scope="package")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def dataset():
    """12 EMT-labelled Cu/Al cells (tests/helpers/training.py), for the training-step tests."""
    return training.emt_dataset()


@pytest.fixture(scope="module")
def fitted(dataset):
    """``(composition weights, energy scale)`` fitted to ``dataset``."""
    return dataset.fit_composition_and_scale()
