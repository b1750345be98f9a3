"""Packed and donated tensors in petfunc.compile (petfunc.compile.donation): the call
path's C++ pytree, outputs written into donated buffers, the trace cache keeping
the donation."""

from typing import NamedTuple

import pytest
import torch
from torch.utils import _pytree as pytree

import petfunc
from petfunc.compile import donation
from tests.helpers.compile_toys import (
    assert_state_close,
    clone,
    example,
    momentum_step,
    packed_state,
)


class _Pair(NamedTuple):
    first: object
    second: object


def test_call_path_pytree_equals_python_pytree():
    """The call path flattens and unflattens with torch's C++ pytree (optree), in
    the Python pytree's leaf order. Anything that differs from the example (dict
    order, a tensor where the example had None or a constant, another constant)
    goes to the Python path, which says what differs."""
    example_tree = (
        {"b": torch.ones(2), "a": [torch.zeros(()), None, 3]},
        _Pair(torch.ones(1), {"x": None, "y": 2.0}),
    )
    leaves, spec = pytree.tree_flatten(example_tree)
    fast = donation.fast_tree(spec)
    if donation.cxx_pytree is None:
        assert fast is None
        return
    got = fast.flatten(example_tree)
    assert len(got) == len(leaves) and all(a is b for a, b in zip(got, leaves))
    rebuilt = fast.unflatten(leaves)
    assert pytree.tree_structure(rebuilt) == spec and type(rebuilt[1]) is _Pair
    assert list(rebuilt[0]) == ["b", "a"] and list(rebuilt[1].second) == ["x", "y"]
    reordered = ({"a": example_tree[0]["a"], "b": example_tree[0]["b"]}, example_tree[1])
    assert fast.flatten(reordered) is None
    filled = ({"b": torch.ones(2), "a": [torch.zeros(()), torch.ones(1), 3]}, example_tree[1])

    def fn(tree_, scale):
        (first, pair) = tree_
        return {"sum": first["b"].sum() * first["a"][2] + pair.first.sum() * pair.second["y"] * scale}

    compiled = petfunc.compile(fn, example_tree, torch.tensor(2.0), backend="aot_eager", static_argnums=())
    assert compiled.uses_fast_pytree()
    torch.testing.assert_close(compiled(example_tree, torch.tensor(3.0)), fn(example_tree, torch.tensor(3.0)))
    with pytest.raises(TypeError, match="structure"):
        compiled(reordered, torch.tensor(3.0))
    with pytest.raises(TypeError, match="structure"):
        compiled(filled, torch.tensor(3.0))
    other_constant = ({"b": torch.ones(2), "a": [torch.zeros(()), None, 4]}, example_tree[1])
    with pytest.raises(ValueError, match="non-tensor argument 4"):
        compiled(other_constant, torch.tensor(3.0))


@pytest.mark.parametrize("order", ["same", "swapped", "passthrough", "old_view"])
def test_donated_state_is_updated_in_place(order):
    """With ``donate_argnums`` the graph writes the new parameters and moments into
    the buffers of the state it was given; the results equal the function's, step
    after step, for any pairing of outputs with donated buffers (an output may even
    be a donated input itself, passed through, or another output a view of one)."""

    def step(state, positions, index):
        (params, moment), energy = momentum_step(state, positions, index)
        if order == "swapped":  # the moment goes back into the parameters' buffer
            return (moment, params), energy
        if order == "passthrough":  # the old parameters, unchanged
            return (state[0], moment), energy
        if order == "old_view":  # an output that is the old value of a donated tensor
            return (params, moment), state[0]["v"]
        return (params, moment), energy

    state = packed_state()
    compiled = petfunc.compile(step, state, *example(4, 7), backend="aot_eager", donate_argnums=(0,))
    reference = clone(state)
    for n_atoms, n_edges in ((4, 7), (9, 30), (6, 11), (9, 30)):
        x = example(n_atoms, n_edges, seed=n_atoms)
        buffers = [petfunc.tree.ravel(pytree.tree_leaves(part)) for part in state]
        old_leaves = pytree.tree_leaves(state)
        expected, expected_energy = step(clone(reference), *x)
        state, energy = compiled(state, *x)
        torch.testing.assert_close(energy, expected_energy, rtol=1e-12, atol=1e-12)
        assert_state_close(state, expected)
        # the new state lives in the donated buffers: no new memory
        new_buffers = [petfunc.tree.ravel(pytree.tree_leaves(part)) for part in state]
        assert {b.data_ptr() for b in new_buffers} == {b.data_ptr() for b in buffers}
        if order == "same":  # the very same view objects, now showing the new values
            assert all(a is b for a, b in zip(pytree.tree_leaves(state), old_leaves))
        reference = expected
    assert compiled.num_graphs == 1


def test_donation_never_writes_memory_the_caller_keeps():
    """A state that is not packed is copied into fresh buffers before the graph
    overwrites them; one buffer donated twice is copied once. Either way the
    caller's tensors keep their values. Without donation nothing is written."""
    x = example(9, 30, seed=3)
    state = packed_state(1)
    expected, _ = momentum_step(clone(state), *x)
    compiled = petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager", donate_argnums=(0,))
    # separate tensors, not views of one buffer
    loose = clone(state)
    kept = clone(loose)
    out, _ = compiled(loose, *x)
    assert_state_close(out, expected)
    assert_state_close(loose, kept)
    # the same buffer as parameters and moment (now overwritten: it was donated)
    twice = (state[0], state[0])
    expected_twice, _ = momentum_step(clone(twice), *x)
    out, _ = compiled(twice, *x)
    assert_state_close(out, expected_twice)
    assert (
        petfunc.tree.ravel(pytree.tree_leaves(out[0])).data_ptr()
        != petfunc.tree.ravel(pytree.tree_leaves(out[1])).data_ptr()
    )
    # no donation: the inputs are untouched
    state = packed_state(1)
    plain = petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager")
    kept = clone(state)
    out, _ = plain(state, *x)
    assert_state_close(state, kept)
    assert_state_close(out, expected)
    with pytest.raises(ValueError, match="static_argnums"):
        petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager", donate_argnums=(1,))


def test_donation_survives_the_trace_cache(tmp_path, monkeypatch):
    """Which outputs go into which donated buffers is part of the cached trace, and
    donating or not are different cache entries."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    x = example(9, 30, seed=3)
    state = packed_state(2)
    expected, _ = momentum_step(clone(state), *x)
    for _ in range(2):
        plain = petfunc.compile(
            momentum_step, state, *example(4, 7), backend="aot_eager", cache_key="momentum"
        )
    assert plain.from_cache
    first = petfunc.compile(
        momentum_step, state, *example(4, 7), backend="aot_eager", cache_key="momentum", donate_argnums=(0,)
    )
    assert not first.from_cache
    second = petfunc.compile(
        momentum_step, state, *example(4, 7), backend="aot_eager", cache_key="momentum", donate_argnums=(0,)
    )
    assert second.from_cache
    out, _ = second(state, *x)
    assert_state_close(out, expected)
    assert (
        petfunc.tree.ravel(pytree.tree_leaves(out[0])).data_ptr()
        == petfunc.tree.ravel(pytree.tree_leaves(state[0])).data_ptr()
    )


def test_donated_state_with_inductor():
    """Inductor, directly and through AOTAutograd, writes the new state into the
    donated buffers (the graph's ``copy_`` into its inputs) with the same numbers as
    the function, step after step."""
    for aot in (False, True):
        state = packed_state(4)
        reference = clone(state)
        buffers = {petfunc.tree.ravel(pytree.tree_leaves(part)).data_ptr() for part in state}
        compiled = petfunc.compile(
            momentum_step,
            state,
            *example(4, 7),
            options={"fx_graph_cache": False},
            aot_autograd=aot,
            donate_argnums=(0,),
        )
        for n_atoms, n_edges in ((4, 7), (9, 30), (40, 300)):
            x = example(n_atoms, n_edges, seed=n_atoms)
            reference, expected_energy = momentum_step(reference, *x)
            state, energy = compiled(state, *x)
            torch.testing.assert_close(energy, expected_energy, rtol=1e-12, atol=1e-12)
            assert_state_close(state, reference)
            assert {petfunc.tree.ravel(pytree.tree_leaves(part)).data_ptr() for part in state} == buffers
        assert compiled.num_graphs == 1
