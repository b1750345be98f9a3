"""petfunc.compile of a training step on a packed state (petfunc.init_state): each
packed run of leaves is one graph input and one output; the layout never changes a
value; the compiled step keeps freed memory for CPU inputs."""

import pytest
import torch
from torch.utils import _pytree as pytree

import petfunc
from petfunc import train as train_mod
from tests.helpers.compile_toys import is_packed


def random_tree(seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "a": torch.randn(3, 4, generator=g, dtype=dtype),
        "b": [torch.randn(5, generator=g, dtype=dtype), torch.randn(2, 2, generator=g, dtype=dtype)],
        "c": torch.randn(7, 3, generator=g, dtype=dtype),
    }


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
