"""Trained and frozen parameters: ``petfunc.partition`` / ``petfunc.combine`` against
hand-written selections, under grad and vmap."""

import pytest
import torch

import petfunc
from tests.helpers.toolkit import energy_loss, toy_batch, toy_params


def same_tree(a, b) -> bool:
    """One structure and the very same tensors."""
    leaves_a, spec_a = petfunc.tree.tree_flatten(a)
    leaves_b, spec_b = petfunc.tree.tree_flatten(b)
    return spec_a == spec_b and all(x is y for x, y in zip(leaves_a, leaves_b))


@pytest.mark.parametrize(
    "train, expected",
    [
        (None, lambda path, leaf: path.split(".")[0] not in petfunc.train.FROZEN),
        (("mlp", "readout"), lambda path, leaf: path.startswith(("mlp", "readout"))),
        (lambda path, leaf: leaf.dim() == 1, lambda path, leaf: leaf.dim() == 1 and "." in path),
    ],
    ids=["default", "prefixes", "predicate"],
)
def test_partition_selects_as_by_hand_and_combine_restores_the_tree(train, expected):
    params = toy_params()
    trained, frozen = petfunc.partition(params, train)
    flat = petfunc.tree.flatten(params)
    by_hand = {path: leaf for path, leaf in flat.items() if expected(path, leaf)}
    assert list(trained) == list(by_hand) and all(trained[k] is by_hand[k] for k in by_hand)
    flat_frozen = petfunc.tree.flatten(frozen)
    assert all((flat_frozen[k] is None) == (k in by_hand) for k in flat)
    assert all(flat_frozen[k] is flat[k] for k in flat if k not in by_hand)
    assert same_tree(petfunc.combine(trained, frozen), params)
    assert petfunc.train.partition is petfunc.partition and petfunc.train.combine is petfunc.combine


def test_gradient_of_the_trained_part_equals_autograd_on_the_whole_tree():
    params, batch = toy_params(), toy_batch()
    trained, frozen = petfunc.partition(params, ("mlp",))
    grads = torch.func.grad(lambda t: energy_loss(petfunc.combine(t, frozen), batch)[0])(trained)
    # by hand: autograd of the whole tree, read at the trained paths
    leaves, spec = petfunc.tree.tree_flatten(params)
    variables = [leaf.detach().requires_grad_(True) for leaf in leaves]
    loss = energy_loss(petfunc.tree.tree_unflatten(variables, spec), batch)[0]
    reference = dict(zip(petfunc.tree.flatten(params), torch.autograd.grad(loss, variables)))
    assert list(grads) == list(trained)
    for path, grad in grads.items():
        assert torch.allclose(grad, reference[path], rtol=1e-12, atol=1e-14), path


def test_vmap_over_stacked_trained_parts_equals_a_loop():
    batch = toy_batch()
    members = [toy_params(seed) for seed in (0, 1, 2)]
    frozen = petfunc.partition(members[0], ("readout",))[1]
    trained = [petfunc.partition(m, ("readout",))[0] for m in members]
    losses = torch.func.vmap(lambda t: energy_loss(petfunc.combine(t, frozen), batch)[0])(
        petfunc.tree.stack(trained)
    )
    for i, t in enumerate(trained):
        assert torch.allclose(losses[i], energy_loss(petfunc.combine(t, frozen), batch)[0], rtol=1e-13)


def test_combine_refuses_parts_of_two_partitions():
    params = toy_params()
    heads, frozen = petfunc.partition(params, ("readout",))
    other = petfunc.partition(params, ("mlp",))[0]
    with pytest.raises(ValueError, match=r"combine: '.*readout.*' is a hole in the frozen tree"):
        petfunc.combine(other, frozen)
    with pytest.raises(ValueError, match=r"combine: the trained parameter 'mlp.*' has no hole"):
        petfunc.combine({**heads, **other}, frozen)
    with pytest.raises(ValueError, match=r"selects no parameter"):
        petfunc.partition(params, lambda path, leaf: False)
