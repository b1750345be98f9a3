"""Parameter trees (petfunc.tree): ``tree_map`` keeps the NamedTuples of a tree."""

import torch

import petfunc


F64 = torch.float64
CONFIG = petfunc.PETConfig(atomic_types=(1, 6), d_pet=4, d_node=8, d_head=4, d_feedforward=4, num_heads=2)


def test_tree_map_keeps_named_tuples():
    """A NamedTuple is rebuilt from its mapped fields, not called with a generator of
    them."""
    params = petfunc.PET(CONFIG).init(seed=3, dtype=F64)
    state = petfunc.TrainState(params, (torch.zeros(2),))
    doubled = petfunc.tree.tree_map(lambda t: 2 * t, state)
    assert type(doubled) is petfunc.TrainState and isinstance(doubled.opt_state, tuple)
    assert torch.equal(
        petfunc.tree.flatten(doubled.params)["energy_scale"], 2 * petfunc.tree.flatten(params)["energy_scale"]
    )
