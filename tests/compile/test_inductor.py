"""petfunc.compile with inductor (petfunc.compile.inductor): directly, without
AOTAutograd, and again with scalar kernels where inductor cannot vectorize a CPU
kernel."""

import pytest
import torch
from torch.utils import _pytree as pytree

import petfunc
from petfunc.compile import inductor
from tests.helpers.compile_toys import accumulate_into_atoms


def test_inductor_without_aotautograd(monkeypatch):
    """Inductor gets one functionalized, decomposed re-trace of the graph instead of
    AOTAutograd's two re-traces (5-15 s of a training step's cold compile): the
    same numbers as eager and as the path through AOTAutograd, one graph for every
    size, and no AOTAutograd call. The function updates fresh temporaries in place
    and writes through views of a fresh buffer, as the optimizer step does: handed
    to inductor without functionalization, that compiled to wrong numbers (2.2 off)."""
    from torch._dynamo.utils import counters

    def fn(state, g):
        p, m0, v0, count = state
        count = count + 1
        bias = 1.0 - torch.exp(count.to(torch.float64) * -0.1)
        m = torch.lerp(m0, g, 0.1)
        v = (v0 * 0.999).addcmul_(g, g, value=0.001)
        update = ((-1e-3 / bias).to(p.dtype) * m).div_(v.sqrt().div_(bias.sqrt().to(p.dtype)).add_(1e-8))
        update = update.sub_(0.01 * p)
        out = torch.zeros(2 * p.shape[0], dtype=p.dtype)
        out[: p.shape[0]].copy_(p + update)
        out[p.shape[0] :].add_(m)
        return (out[: p.shape[0]], m, v, count), out.softmax(0)

    def aot_calls():
        return sum(counters["aot_autograd"].values())

    def inputs(n, seed):
        g = torch.Generator().manual_seed(seed)
        p, m, g_ = (torch.randn(n, generator=g, dtype=torch.float64) for _ in range(3))
        return (p, m, torch.rand(n, generator=g, dtype=torch.float64), torch.tensor(seed)), g_

    results = {}
    for aot in (False, True):
        before = aot_calls()
        compiled = petfunc.compile(
            fn, *inputs(7, 0), static_argnums=(), options={"fx_graph_cache": False}, aot_autograd=aot
        )
        results[aot] = []
        for n in (7, 30, 1000):
            got, want = compiled(*inputs(n, n)), fn(*inputs(n, n))
            for a, b in zip(pytree.tree_leaves(got), pytree.tree_leaves(want)):
                torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
            results[aot].append(got)
        assert compiled.num_graphs == 1
        assert (aot_calls() > before) == aot, "counter idle" if aot else "AOTAutograd ran"
    monkeypatch.setenv("PETFUNC_DIRECT_INDUCTOR", "0")  # the environment's default
    assert petfunc.compile(fn, *inputs(7, 0), static_argnums=()).aot_autograd
    for a, b in zip(pytree.tree_leaves(results[False]), pytree.tree_leaves(results[True])):
        torch.testing.assert_close(a, b, rtol=1e-14, atol=1e-14)


def test_inductor_scatter_into_one_atom():
    """A scatter into a buffer of one element, as for the per-atom sums of a lone
    one-atom cell (a size torch specialises): torch 2.11 and 2.13's inductor failed
    an assertion while writing its vectorized ``atomic_add`` (the index is a
    constant there), which crashed ``petfunc.compile`` on such a structure alone.
    The graph is compiled again with scalar kernels; the numbers are eager's."""
    g = torch.Generator().manual_seed(0)
    positions, values = (
        torch.randn(1, 3, generator=g, dtype=torch.float64),
        torch.randn(7, generator=g, dtype=torch.float64),
    )
    index = torch.zeros(7, dtype=torch.long)
    compiled = petfunc.compile(
        accumulate_into_atoms, positions, values, index, static_argnums=(), options={"fx_graph_cache": False}
    )
    for n_edges in (7, 30):
        values = torch.randn(n_edges, generator=g, dtype=torch.float64)
        index = torch.zeros(n_edges, dtype=torch.long)
        torch.testing.assert_close(
            compiled(positions, values, index),
            accumulate_into_atoms(positions, values, index),
            rtol=1e-14,
            atol=1e-14,
        )
    assert compiled.num_graphs == 1


def _raise_from(filename):
    """An AssertionError raised by code that claims to live in ``filename``."""
    namespace = {}
    exec(compile("def fail():\n    assert False, 'index.is_vec'\n", filename, "exec"), namespace)
    try:
        namespace["fail"]()
    except AssertionError as error:
        return error


@pytest.mark.parametrize("where", ["codegen/cpp.py", "elsewhere.py"])
def test_inductor_codegen_assertion_is_retried_without_vectors(monkeypatch, where):
    """Only an assertion of inductor's C++ code generator makes petfunc.compile
    compile again with ``cpp.simdlen=1`` (and warn); any other failure reaches the
    caller unchanged, from the first attempt."""
    import torch._inductor.exc

    seen = []

    def failing_once(graph, mode, fakes):
        seen.append(torch._inductor.config.cpp.simdlen)
        if len(seen) == 1:
            inner = _raise_from(f"/site-packages/torch/_inductor/{where}")
            raise torch._inductor.exc.InductorError(inner, None).with_traceback(inner.__traceback__) from None
        return lambda *inputs: graph(*inputs)

    monkeypatch.setattr(inductor, "compile_inductor_direct", failing_once)
    positions, values = torch.randn(4, 3, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    index = torch.arange(9) % 4
    compiled = petfunc.compile(
        accumulate_into_atoms, positions, values, index, static_argnums=(), aot_autograd=False
    )
    if where == "elsewhere.py":
        with pytest.raises(torch._inductor.exc.InductorError, match="index.is_vec"):
            compiled(positions, values, index)
        assert len(seen) == 1
        return
    with pytest.warns(UserWarning, match="cpp.simdlen=1"):
        got = compiled(positions, values, index)
    torch.testing.assert_close(got, accumulate_into_atoms(positions, values, index), rtol=1e-14, atol=1e-14)
    assert seen[1] == 1 and seen[0] != 1
