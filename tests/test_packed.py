"""Packed storage: trees whose tensors are views of one buffer.

``petfunc.init_state`` packs the trained parameters and each optimizer moment into
one buffer; the optimizer step then works on whole vectors (one fused kernel when
compiled instead of one per parameter tensor), and ``petfunc.compile`` passes each
packed run of leaves as one graph input and returns it as one output. The layout
must never change a value: packed and unpacked inputs give the same numbers.
"""

import pytest
import torch
import torchopt
from torch.utils import _pytree as pytree

import petfunc
from petfunc.train import step as train_mod
from petfunc import tree


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
    state = petfunc.TrainState(params, optimizer.init(train_mod.trainable(params)))
    packed = petfunc.pack_state(state)
    trained = pytree.tree_leaves(train_mod.trainable(packed.params))
    assert is_packed(trained)
    adam_state = packed.opt_state[0]  # torchopt keeps the moments as lists of leaves
    assert is_packed(adam_state.mu) and is_packed(adam_state.nu)
    assert adam_state.mu[0].data_ptr() != adam_state.nu[0].data_ptr()
    for a, b in zip(pytree.tree_leaves(packed), pytree.tree_leaves(state)):
        assert torch.equal(a, b)


# ---------------------------------------------------------------------------------------
# compiled


def toy_loss(params, batch):
    positions, index, target = batch
    hidden = torch.tanh(positions[index] @ params["a"][:3] + params["b"][0][:4])
    out = torch.zeros(positions.shape[0], hidden.shape[1], dtype=positions.dtype).index_add(0, index, hidden)
    energy = (out @ params["c"][:4]).sum(1) + params["b"][1].sum()
    loss = ((energy - target) ** 2).mean()
    return loss, {"loss": loss}


def toy_batch(n_atoms, n_edges, seed):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randn(n_atoms, 3, generator=g, dtype=torch.float64)
    index = torch.randint(0, n_atoms, (n_edges,), generator=g)
    return positions, index, torch.randn(n_atoms, generator=g, dtype=torch.float64)


def test_compiled_step_takes_and_returns_packed_buffers(tmp_path, monkeypatch):
    optimizer = petfunc.make_optimizer(1e-2)
    step = train_mod.train_step_of(train_mod.grad_step_of(toy_loss), optimizer)
    state = petfunc.init_state(random_tree(2), optimizer)
    batches = [toy_batch(n, e, seed=n) for n, e in ((4, 9), (7, 20), (5, 5))]
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    compiled = petfunc.compile(step, state, batches[0], backend="aot_eager", cache_key="packed toy")
    # params, mu and nu: one input each (plus the step count and the batch's three)
    inputs = [n for n in compiled.graph.graph.nodes if n.op == "placeholder"]
    assert len(inputs) == 3 + 1 + 3
    eager_state, compiled_state = state, state
    for batch in batches:
        eager_state, eager_metrics = step(eager_state, batch)
        compiled_state, metrics = compiled(compiled_state, batch)
        torch.testing.assert_close(metrics, eager_metrics, rtol=1e-12, atol=1e-14)
        for a, b in zip(pytree.tree_leaves(compiled_state), pytree.tree_leaves(eager_state)):
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-14)
        assert is_packed(pytree.tree_leaves(compiled_state.params))
        assert is_packed(pytree.tree_leaves(compiled_state.opt_state.nu))
    assert compiled.num_graphs == 1
    # the same state in separate tensors (copied into a buffer per call): same numbers
    loose = pytree.tree_map(lambda t: t.clone(), state)
    assert not is_packed(pytree.tree_leaves(loose.params))
    for a, b in zip(
        pytree.tree_leaves(compiled(loose, batches[1])), pytree.tree_leaves(compiled(state, batches[1]))
    ):
        assert torch.equal(a, b)
    # a state with one tensor replaced: no longer packed, still right
    replaced = state._replace(params={**state.params, "a": state.params["a"] + 1.0})
    torch.testing.assert_close(
        compiled(replaced, batches[2]), step(replaced, batches[2]), rtol=1e-12, atol=1e-14
    )
    # a parameter of another shape inside a packed run is refused by name
    wrong = state._replace(params={**state.params, "c": torch.zeros(3, 7, dtype=torch.float64)})
    with pytest.raises(ValueError, match="parameter or optimizer state"):
        compiled(wrong, batches[0])
    # the trace cache keeps the output layout: a reloaded trace returns packed buffers
    again = petfunc.compile(step, state, batches[0], backend="aot_eager", cache_key="packed toy")
    assert again.from_cache
    new_state, metrics = again(state, batches[1])
    assert is_packed(pytree.tree_leaves(new_state.params))
    torch.testing.assert_close(metrics, step(state, batches[1])[1], rtol=1e-12, atol=1e-14)


def test_compile_keeps_freed_memory_for_cpu_inputs(monkeypatch):
    """A packed state leaves the graph as model-sized buffers at every call; with
    glibc's defaults they are unmapped when freed and faulted in again the next
    step, so petfunc.compile keeps freed memory by default (CPU inputs only)."""
    from petfunc import allocator

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda *a: calls.append(a) or True)

    def fn(params, x):
        return (params["w"] * x).sum()

    args = ({"w": torch.ones(3)}, torch.ones(4, 3))
    for keep, expected in [(True, 1), (False, 0)]:
        calls.clear()
        compiled = petfunc.compile(fn, *args, backend="aot_eager", keep_freed_memory=keep)
        assert len(calls) == expected, keep
        assert float(compiled(*args)) == 12.0
    calls.clear()
    petfunc.compile(
        fn, {"w": torch.ones(3, device="meta")}, torch.ones(4, 3, device="meta"), backend="aot_eager"
    )
    assert not calls  # no CPU tensor: nothing to keep
