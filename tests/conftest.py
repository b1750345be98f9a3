"""Shared test setup.

Tests run with one torch thread: the tensors are small, and on a shared 2-core
machine two threads fight the other process and make tests many times slower.
"""

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
