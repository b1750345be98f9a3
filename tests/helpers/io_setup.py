"""The small PETs of the file tests (tests/io/), and metatrain's shipped checkpoints."""

import os

import pytest
import torch

import petfunc


SMALL = dict(d_pet=8, d_node=16, d_head=8, d_feedforward=16, num_heads=2)


def small_config(**kw):
    """A small PET config for H, C and O (``kw`` overrides)."""
    return petfunc.PETConfig(atomic_types=(1, 6, 8), **{**SMALL, **kw})


def small_params(config, dtype=torch.float64, seed=0):
    """Parameters of ``config`` with a float64 composition and energy scale."""
    params = petfunc.PET(config).init(seed=seed, dtype=dtype)
    params["composition_weights"] = torch.tensor([-13.6, -1029.5, -2041.3], dtype=torch.float64)
    params["energy_scale"] = torch.tensor(0.42, dtype=torch.float64)
    return params


def assert_same_params(a, b):
    """The trees have the same names in the same order, dtypes and values, bit for bit."""
    fa, fb = petfunc.tree.flatten(a), petfunc.tree.flatten(b)
    assert list(fa) == list(fb)
    for key in fa:
        assert fa[key].dtype == fb[key].dtype, key
        assert torch.equal(fa[key], fb[key]), key


def metatrain_reference():
    """tests/helpers/mtt_reference.py; skips the test where metatrain is not installed."""
    pytest.importorskip("metatrain")
    from tests.helpers import mtt_reference

    return mtt_reference


def metatrain_checkpoint(name):
    """The path of the checkpoint ``name`` shipped with metatrain's PET tests."""
    import metatrain.pet

    return os.path.join(os.path.dirname(metatrain.pet.__file__), "tests", "checkpoints", name)
