"""Packed storage: trees whose tensors are views of one buffer.

``petfunc.init_state`` packs the trained parameters and each optimizer moment into
one buffer; the optimizer step then works on whole vectors (one fused kernel when
compiled instead of one per parameter tensor), and ``petfunc.compile`` passes each
packed run of leaves as one graph input and returns it as one output. The layout
must never change a value: packed and unpacked inputs give the same numbers. (The
compiled step on a packed state: tests/compile/test_packed.py.)
"""

import pytest
import torch
import torchopt
from torch.utils import _pytree as pytree

import petfunc
from petfunc import tree
from petfunc.train import optim as train_mod


def random_tree(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 4, generator=g, dtype=dtype),
        "b": [torch.randn(5, generator=g, dtype=dtype), torch.randn(2, 2, generator=g, dtype=dtype)],
        "c": torch.randn(7, 3, generator=g, dtype=dtype),
    }


def is_packed(leaves):
    return tree.packed_range(list(leaves)) is not None


def test_ravel_is_a_view_only_for_packed_leaves():
    original = random_tree()
    leaves = pytree.tree_leaves(original)
    packed = pytree.tree_leaves(tree.pack(original))
    expected = torch.cat([x.reshape(-1) for x in leaves])
    assert is_packed(packed) and not is_packed(leaves)
    flat = tree.ravel(packed)
    assert flat.data_ptr() == packed[0].data_ptr() and torch.equal(flat, expected)
    # consecutive leaves in the middle of the buffer: still a view
    middle = tree.ravel(packed[1:3])
    assert middle.data_ptr() == packed[1].data_ptr()
    assert torch.equal(middle, torch.cat([leaves[1].reshape(-1), leaves[2].reshape(-1)]))
    # out of order, a gap, a transposed view, separate tensors: copies, right values
    for pieces in ([packed[1], packed[0]], [packed[0], packed[2]], [packed[0].t(), packed[1]], leaves):
        out = tree.ravel(pieces)
        assert out.data_ptr() != pieces[0].data_ptr()
        assert torch.equal(out, torch.cat([x.reshape(-1) for x in pieces]))
    # unravel is the inverse
    for a, b in zip(tree.unravel(expected, [x.shape for x in leaves]), leaves):
        assert torch.equal(a, b)


@pytest.mark.parametrize("weight_decay", [None, 0.01])
def test_whole_vector_adam_equals_leaf_by_leaf(monkeypatch, weight_decay):
    """The packed optimizer step is elementwise the same computation as per leaf."""
    params = tree.pack(random_tree(0))
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-2, 10, 0.2), weight_decay)
    results = {}
    for mode in ("packed", "leaves"):
        if mode == "leaves":
            monkeypatch.setattr(train_mod, "_flat_leaves", lambda *trees: None)
        state, p, out = optimizer.init(params), params, []
        for step in range(3):
            grads = random_tree(10 + step)
            clipped, norm = train_mod.clip_by_global_norm(grads, 1.0)
            updates, state = optimizer.update(clipped, state, params=p)
            p = train_mod.apply_updates(p, updates)
            out.append((p, state, norm))
        results[mode] = out
        monkeypatch.undo()
    for (p1, s1, n1), (p2, s2, n2) in zip(results["packed"], results["leaves"]):
        # one norm over a vector vs a norm of per-leaf norms: round-off apart
        torch.testing.assert_close(n1, n2, rtol=1e-14, atol=0)
        for a, b in zip(pytree.tree_leaves((p1, s1)), pytree.tree_leaves((p2, s2))):
            torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-16)
    # the whole-vector path keeps the new parameters and moments packed
    p, state, _ = results["packed"][-1]
    assert is_packed(pytree.tree_leaves(p)) and is_packed(pytree.tree_leaves(state.mu))


def test_pack_state_packs_every_moment_tree():
    """A state assembled by hand (torchopt's Adam here): the parameters and each tree
    of the optimizer state shaped like them end up in a buffer each."""
    params = {**random_tree(1), "composition_weights": torch.zeros(3, dtype=torch.float64)}
    optimizer = torchopt.adam(1e-3)
    state = petfunc.TrainState(params, optimizer.init(petfunc.train.trainable(params)))
    packed = petfunc.pack_state(state)
    trained = pytree.tree_leaves(petfunc.train.trainable(packed.params))
    assert is_packed(trained)
    adam_state = packed.opt_state[0]  # torchopt keeps the moments as lists of leaves
    assert is_packed(adam_state.mu) and is_packed(adam_state.nu)
    assert adam_state.mu[0].data_ptr() != adam_state.nu[0].data_ptr()
    for a, b in zip(pytree.tree_leaves(packed), pytree.tree_leaves(state)):
        assert torch.equal(a, b)
