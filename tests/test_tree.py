"""Parameter trees (petfunc.tree): ``tree_map`` keeps the NamedTuples of a tree."""

import pytest
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


# -----------------------------------------------------------------------------------
# tree algebra, against hand-written equivalents


def mixed_tree():
    g = torch.Generator().manual_seed(0)
    return {
        "w": torch.randn(3, 2, generator=g, dtype=F64),
        "layers": [
            {"b": torch.randn(4, generator=g, dtype=torch.float32)},
            {"b": torch.randn(2, generator=g, dtype=F64)},
        ],
        "count": torch.tensor(7, dtype=torch.int64),
        "scale": torch.tensor(0.5, dtype=F64),
    }


def test_ravel_pytree_concatenates_leaves_in_order_and_unravel_restores_them():
    tree = mixed_tree()
    flat, unravel = petfunc.tree.ravel_pytree(tree)
    leaves = petfunc.tree.tree_leaves(tree)
    expected = torch.cat([leaf.reshape(-1).to(F64) for leaf in leaves])  # promoted to float64
    assert flat.dtype == F64 and flat.dim() == 1 and torch.equal(flat, expected)
    back = unravel(flat)
    for before, after in zip(leaves, petfunc.tree.tree_leaves(back)):
        assert after.dtype == before.dtype and after.shape == before.shape and torch.equal(after, before)
    assert isinstance(back["layers"], list)
    # a new tensor, not a view of the leaves
    flat.zero_()
    assert tree["w"].abs().sum() > 0
    with pytest.raises(ValueError, match=r"expected a 1-d tensor of 14 entries"):
        unravel(torch.zeros(13, dtype=F64))
    with pytest.raises(TypeError, match=r"leaf at 'x' is a str"):
        petfunc.tree.ravel_pytree({"x": "text"})


def test_ravel_pytree_under_grad_and_vmap():
    tree = {"a": torch.randn(2, 3, dtype=F64), "b": [torch.randn(4, dtype=F64)]}
    _, unravel = petfunc.tree.ravel_pytree(tree)

    def energy(flat):
        t = unravel(flat)
        return (t["a"] ** 2).sum() + t["b"][0].sum()

    flat = petfunc.tree.ravel_pytree(tree)[0]
    grad = torch.func.grad(energy)(flat)
    assert torch.equal(grad, torch.cat([2 * tree["a"].reshape(-1), torch.ones(4, dtype=F64)]))
    stacked = petfunc.tree.stack([tree, petfunc.tree.tree_scale(2.0, tree)])
    flats = torch.func.vmap(lambda t: petfunc.tree.ravel_pytree(t)[0])(stacked)
    assert torch.equal(flats[1], 2 * flats[0])


def test_tree_vdot_add_scale_equal_leafwise_loops():
    x, y, z = mixed_tree(), petfunc.tree.tree_map(lambda t: t + 1, mixed_tree()), mixed_tree()
    expected = sum((a * b).sum() for a, b in zip(petfunc.tree.tree_leaves(x), petfunc.tree.tree_leaves(y)))
    assert torch.equal(petfunc.tree.tree_vdot(x, y), expected)
    total = petfunc.tree.tree_add(x, y, z)
    for a, b, c, s in zip(*(petfunc.tree.tree_leaves(t) for t in (x, y, z, total))):
        assert torch.equal(s, a + b + c)
    scaled = petfunc.tree.tree_scale(3.0, x)
    for a, s in zip(petfunc.tree.tree_leaves(x), petfunc.tree.tree_leaves(scaled)):
        assert torch.equal(s, 3.0 * a)
    # keys in another order pair by key
    reordered = {k: x[k] for k in reversed(list(x))}
    assert torch.equal(petfunc.tree.tree_vdot(reordered, y), expected)


def test_tree_map_of_several_trees_names_the_first_differing_key():
    params = petfunc.PET(CONFIG).init(seed=3, dtype=F64)
    flat = petfunc.tree.flatten(params)
    summed = petfunc.tree.tree_map(lambda a, b, c: a + b - c, params, params, params)
    assert all(torch.equal(v, petfunc.tree.flatten(summed)[k]) for k, v in flat.items())
    key = next(k for k in flat if k.startswith("gnn_layers.0.") and k.endswith("bias"))
    fewer = petfunc.tree.unflatten({k: v for k, v in flat.items() if k != key})
    with pytest.raises(ValueError, match=rf"trees differ at '{key}': missing in the second"):
        petfunc.tree.tree_map(torch.add, params, fewer)
    with pytest.raises(ValueError, match=rf"trees differ at '{key}': missing in the first"):
        petfunc.tree.tree_add(fewer, params)
    with pytest.raises(ValueError, match=r"trees differ at 'x': a leaf \(Tensor\) in the first, a list of 2"):
        petfunc.tree.tree_vdot({"x": torch.ones(2)}, {"x": [torch.ones(1), torch.ones(1)]})
    with pytest.raises(
        ValueError, match=rf"parameter tree 1 does not have the structure of tree 0: .*'{key}'"
    ):
        petfunc.tree.stack([params, fewer])
    # a prefix tree meets the other's subtrees, as torch's tree_map
    assert petfunc.tree.tree_map(lambda a, b: len(b), {"x": 0}, {"x": [1, 2]}) == {"x": 2}
