"""petfunc.compile itself: one graph for every size, guards, input checks.

The backend compiles the traced graph with symbolic sizes, without Dynamo; the size
assumptions it makes become a guard checked at every call. A call that breaks them
(here: a size of 1, which torch specialises) compiles a second graph and still
gives the right numbers; a dtype or parameter shape the graph was not traced for
is refused.
"""

import sys
import warnings
from typing import NamedTuple

import pytest
import torch
from torch.utils import _pytree as pytree

import petfunc


def scatter_energy(params, positions, index):
    """A toy with the ingredients of PET's graph: a gather, a matmul, a scatter."""
    hidden = torch.tanh(positions[index] @ params["w"])
    out = torch.zeros(positions.shape[0], hidden.shape[1], dtype=positions.dtype)
    return out.index_add(0, index, hidden).sum(1)


def example(n_atoms, n_edges, seed=0):
    g = torch.Generator().manual_seed(seed)
    positions = torch.randn(n_atoms, 3, generator=g, dtype=torch.float64)
    index = torch.randint(0, n_atoms, (n_edges,), generator=g)
    return positions, index


def test_one_graph_guards_and_checks():
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    compiled = petfunc.compile(scatter_energy, params, *example(4, 7), backend="aot_eager")
    assert compiled.num_graphs == 0  # compiled at the first call
    for n_atoms, n_edges in ((4, 7), (9, 30), (2, 2), (50, 3)):
        x = example(n_atoms, n_edges, seed=n_atoms)
        torch.testing.assert_close(compiled(params, *x), scatter_energy(params, *x), rtol=1e-12, atol=1e-12)
    assert compiled.num_graphs == 1
    # size 1 breaks the traced graph's assumptions (sizes >= 2): a second graph
    x = example(1, 3)
    torch.testing.assert_close(compiled(params, *x), scatter_energy(params, *x), rtol=1e-12, atol=1e-12)
    assert compiled.num_graphs == 2
    x = example(6, 11)
    torch.testing.assert_close(compiled(params, *x), scatter_energy(params, *x), rtol=1e-12, atol=1e-12)
    assert compiled.num_graphs == 2
    with pytest.raises(TypeError, match="float32"):
        compiled(params, x[0].float(), x[1])
    with pytest.raises(ValueError, match="parameter"):
        compiled({"w": torch.randn(3, 6, dtype=torch.float64)}, *x)
    with pytest.raises(TypeError, match="structure"):
        compiled({"w": params["w"], "b": params["w"]}, *x)


class _Pair(NamedTuple):
    first: object
    second: object


def test_call_path_pytree_equals_python_pytree():
    """The call path flattens and unflattens with torch's C++ pytree (optree), in
    the Python pytree's leaf order. Anything that differs from the example (dict
    order, a tensor where the example had None or a constant, another constant)
    goes to the Python path, which says what differs."""
    compile_module = sys.modules["petfunc.compile"]
    example_tree = (
        {"b": torch.ones(2), "a": [torch.zeros(()), None, 3]},
        _Pair(torch.ones(1), {"x": None, "y": 2.0}),
    )
    leaves, spec = pytree.tree_flatten(example_tree)
    fast = compile_module._fast_tree(spec)
    if compile_module._cxx_pytree is None:
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
    assert compiled._fast_in is not None
    torch.testing.assert_close(compiled(example_tree, torch.tensor(3.0)), fn(example_tree, torch.tensor(3.0)))
    with pytest.raises(TypeError, match="structure"):
        compiled(reordered, torch.tensor(3.0))
    with pytest.raises(TypeError, match="structure"):
        compiled(filled, torch.tensor(3.0))
    other_constant = ({"b": torch.ones(2), "a": [torch.zeros(()), None, 4]}, example_tree[1])
    with pytest.raises(ValueError, match="non-tensor argument 4"):
        compiled(other_constant, torch.tensor(3.0))


def test_views_and_strides_reuse_the_graph():
    """Committee members are views into stacked tensors (storage offsets, as
    petfunc.tree.unstack makes them), data may come transposed: same graph."""
    stacked = torch.randn(3, 3, 5, dtype=torch.float64)
    members = [{"w": stacked[k]} for k in range(3)]
    compiled = petfunc.compile(scatter_energy, members[0], *example(4, 7), backend="aot_eager")
    positions, index = example(8, 20)
    for member in members:
        torch.testing.assert_close(
            compiled(member, positions, index), scatter_energy(member, positions, index)
        )
    transposed = positions.t().contiguous().t()  # same values, other strides
    torch.testing.assert_close(
        compiled(members[0], transposed, index), scatter_energy(members[0], positions, index)
    )
    assert compiled.num_graphs == 1


def test_trace_cache(tmp_path, monkeypatch):
    """A second Compiled with the same key loads the trace instead of tracing; other
    keys, signatures or a damaged file trace again; the results are the same."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    x = example(4, 7)
    first = petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    assert not first.from_cache and len(list(tmp_path.glob("*.fx.pkl"))) == 1
    second = petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    assert second.from_cache
    for n_atoms, n_edges in ((4, 7), (9, 30)):
        y = example(n_atoms, n_edges, seed=n_atoms)
        torch.testing.assert_close(second(params, *y), scatter_energy(params, *y), rtol=1e-12, atol=1e-12)
    assert second.num_graphs == 1
    # another key, another parameter shape or dtype: a new trace
    assert not petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="other").from_cache
    wide = {"w": torch.randn(3, 6, dtype=torch.float64)}
    assert not petfunc.compile(scatter_energy, wide, *x, backend="aot_eager", cache_key="toy").from_cache
    assert len(list(tmp_path.glob("*.fx.pkl"))) == 3
    # a damaged file: a warning, a fresh trace, the file rewritten
    for damaged in tmp_path.glob("*.fx.pkl"):
        damaged.write_bytes(b"garbage")
    with pytest.warns(UserWarning, match="unreadable trace cache"):
        third = petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    assert not third.from_cache
    assert petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy").from_cache
    # no key, or caching turned off: never cached
    assert not petfunc.compile(scatter_energy, params, *x, backend="aot_eager").from_cache
    monkeypatch.setenv("PETFUNC_TRACE_CACHE", "0")
    assert not petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy").from_cache


def test_trace_cache_keeps_sizes_one_apart(tmp_path, monkeypatch):
    """A trace of an example with one atom (or one structure) has that size fixed:
    loaded from the cache for a larger example, its first call failed its size
    guards. Such examples now have traces of their own."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    one = petfunc.compile(scatter_energy, params, *example(1, 2), backend="aot_eager", cache_key="toy")
    assert not one.from_cache
    many = petfunc.compile(scatter_energy, params, *example(4, 7), backend="aot_eager", cache_key="toy")
    assert not many.from_cache
    y = example(9, 30, seed=9)
    torch.testing.assert_close(many(params, *y), scatter_energy(params, *y), rtol=1e-12, atol=1e-12)
    again = petfunc.compile(
        scatter_energy, params, *example(1, 2, seed=3), backend="aot_eager", cache_key="toy"
    )
    assert again.from_cache
    assert petfunc.compile(
        scatter_energy, params, *example(5, 9), backend="aot_eager", cache_key="toy"
    ).from_cache


def test_trace_cache_reloads_graphs_with_symbolic_size_lists(tmp_path, monkeypatch):
    """A reloaded graph whose ops take lists with symbolic sizes, slices and tensor
    constants loads without a warning and gives the traced results. The trace cache
    stores graphs as plain nodes since torch 2.11 failed to load P3M lattice graphs
    pickled as GraphModules (their code is traced again on load, and an ATen op there
    refused a proxy inside a size list); the slow
    ``test_inductor_p3m_equals_eager[*-reloaded]`` holds such a graph."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))

    def fn(params, positions):
        # a tensor expanded to a data size, as in P3M's lattice code (make_fx keeps this
        # eye as a constant, where P3M's is a node: only the slow P3M test fails on 2.11)
        frames = torch.eye(3, dtype=positions.dtype).unsqueeze(0).expand(positions.shape[0], 3, 3)
        weights = torch.tensor([1.0, -0.5, 2.0], dtype=positions.dtype)
        rotated = (frames * (positions * params["w"])[:, None, :]).sum(-1)
        return (weights * rotated[1:]).sum(), rotated[::2].sum(0)

    params = {"w": torch.randn(3, dtype=torch.float64)}
    first = petfunc.compile(
        fn, params, torch.randn(5, 3, dtype=torch.float64), backend="aot_eager", cache_key="sizes"
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="petfunc.compile")
        second = petfunc.compile(
            fn, params, torch.randn(5, 3, dtype=torch.float64), backend="aot_eager", cache_key="sizes"
        )
    assert not first.from_cache and second.from_cache
    for n in (3, 5, 11):
        positions = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        for got, expected in zip(second(params, positions), fn(params, positions)):
            torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    assert second.num_graphs == 1


def test_graph_specialised_to_a_size_runs_only_for_that_size():
    """A backend may set a data size equal to a number while compiling (here a
    broadcast against a slice of length n - 1 = 1 makes n == 2). Until the forty-fourth
    stop that number was in neither the guard expression (which takes static sizes as
    checked) nor the fixed sizes, so the graph compiled at n = 2 ran for every later n:
    an error at n = 11, a wrong value at n = 1."""

    def fn(params, positions):
        grid = positions.unsqueeze(0).expand(2, positions.shape[0], 3)
        weights = torch.tensor([1.0, -0.5], dtype=positions.dtype)
        return (weights[:, None, None] * grid[:, 1:] * params["w"]).sum(), grid[..., ::2].sum(0)

    params = {"w": torch.randn(3, dtype=torch.float64)}
    compiled = petfunc.compile(fn, params, torch.randn(5, 3, dtype=torch.float64), backend="aot_eager")
    for n in (5, 2, 11, 3, 1, 2):
        positions = torch.randn(n, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(n))
        for got, expected in zip(compiled(params, positions), fn(params, positions)):
            torch.testing.assert_close(got, expected, rtol=1e-14, atol=1e-14)
    assert compiled.num_graphs == 3  # one for n = 5 and any n > 2, one for n = 2, one for n = 1


def test_trace_cache_tells_where_the_nones_are(tmp_path, monkeypatch):
    """pytree flattens None to a leaf, so (x, None) and (None, x) have one spec: the
    cache must still keep their traces apart (a P3M batch's meshes are such a tuple,
    None for each molecule; a crystal's mesh loaded from a trace made for another
    layout gave wrong energies)."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))

    def weighted(params, pair):
        a, b = pair
        out = params["w"].sum()
        if a is not None:
            out = out + 2 * a.sum()
        if b is not None:
            out = out + 3 * b.sum()
        return out

    params = {"w": torch.zeros(2, dtype=torch.float64)}
    x = torch.ones(4, dtype=torch.float64)
    first = petfunc.compile(weighted, params, (x, None), backend="aot_eager", cache_key="pair")
    second = petfunc.compile(weighted, params, (None, x), backend="aot_eager", cache_key="pair")
    assert not second.from_cache
    assert float(first(params, (x, None))) == 8.0 and float(second(params, (None, x))) == 12.0
    assert petfunc.compile(weighted, params, (None, x), backend="aot_eager", cache_key="pair").from_cache


def test_trace_cache_write_failure_leaves_no_file(tmp_path, monkeypatch):
    """A cache file that cannot be written completely (here: fsync fails after the
    bytes went out) costs a warning and a trace in the next process, and leaves
    neither a partial cache file nor its temporary file."""
    import petfunc._files

    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(petfunc._files.os, "fsync", failing_fsync)
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    x = example(4, 7)
    with pytest.warns(UserWarning, match="could not write the trace cache file .*disk full"):
        compiled = petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    torch.testing.assert_close(compiled(params, *x), scatter_energy(params, *x))
    assert list(tmp_path.iterdir()) == []
    monkeypatch.undo()
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    assert not petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy").from_cache
    assert [p.suffix for p in tmp_path.iterdir()] == [".pkl"]


def test_float_sums_of_any_length_share_the_graph():
    """Inductor's C++ backend sums float32 reductions longer than 4096 elements with
    a cascade helper and guarded the length on the example's side of 4096: a graph
    compiled on a small batch recompiled for a large one (only when its kernels were
    not already in inductor's cache). The choice is now made without a guard."""

    def fn(params, positions, index):
        hidden = torch.tanh(positions[index] @ params["w"])
        return hidden.sum(0), hidden.sum()

    params = {"w": torch.randn(3, 5, generator=torch.Generator().manual_seed(0))}
    # fx_graph_cache off: a cached graph hides the guard (its load does not add it)
    compiled = petfunc.compile(
        fn,
        params,
        *[t.float() if t.is_floating_point() else t for t in example(30, 100)],
        options={"fx_graph_cache": False},
    )
    exact = {"w": params["w"].double()}
    for n_atoms, n_edges in ((30, 100), (300, 9000), (20, 50)):
        positions, index = example(n_atoms, n_edges, seed=n_atoms)
        # against float64: a float32 sum of n terms of size <= 1 is off by ~1e-6 n
        # (more where inductor sums without the cascade helper, torch 2.11)
        for a, b in zip(compiled(params, positions.float(), index), fn(exact, positions, index)):
            torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5 * n_edges)
    assert compiled.num_graphs == 1


def test_cascade_helper_only_for_long_float_sums():
    """The choice above follows the example's length: short float32 sums (softmax
    rows, layer norms) are plain vector sums, long ones use the cascade helper. On
    torch 2.13 the example's length was looked up under inductor's old method name,
    the lookup failed, and every sum took the helper (softmax kernels 4-5x slower)."""
    from torch._inductor.utils import run_and_get_code

    def fn(x, bias):
        return (x + bias[:, None, :]).softmax(-1).square().sum(), x.sum()

    def code(n_rows, width):
        x, bias = torch.randn(n_rows, 7, width), torch.randn(n_rows, width)
        compiled = petfunc.compile(fn, x, bias, static_argnums=(), options={"fx_graph_cache": False})
        result, codes = run_and_get_code(lambda: compiled(x, bias))
        for a, b in zip(result, fn(x, bias)):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
        return "\n".join(codes)

    short = code(20, 15)  # rows of 15, whole sum 2100
    assert "CascadeSumHelper" not in short
    assert "CascadeSumHelper" in code(20, 300)  # whole sum 42000 elements


def test_cpu_addmm_split_before_inductor(monkeypatch):
    """CPU ``addmm`` is split into ``mm`` + add before inductor's passes, and
    inductor's merge of ``mm + add`` is held back, so the post-grad pass finds
    nothing left to split (each late split sent inductor's fake-tensor update
    through the rest of the graph). With ``PETFUNC_EARLY_ADDMM_SPLIT=0`` the split
    happens after inductor's merge, as before; the code has no ``addmm`` either way."""
    from torch._inductor.fx_passes import post_grad
    from torch._inductor.utils import run_and_get_code

    if not all(hasattr(post_grad, f) for f in ("should_prefer_unfused_addmm", "is_valid_addmm_fusion")):
        pytest.skip("this torch's inductor has no merge check to hold back")
    compile_module = sys.modules["petfunc.compile"]
    seen = []  # addmm nodes in each graph the split runs on: before inductor, then post-grad
    split = compile_module._unfuse_addmm

    def counting(graph):
        seen.append(sum(n.target is torch.ops.aten.addmm.default for n in graph.nodes))
        split(graph)

    monkeypatch.setattr(compile_module, "_unfuse_addmm", counting)

    def fn(params, x):
        hidden = torch.tanh(torch.nn.functional.linear(x, params["w1"], params["b1"]))
        return (x + hidden @ params["w2"]).square().sum()

    g = torch.Generator().manual_seed(0)
    params = {
        "w1": torch.randn(6, 4, generator=g),
        "b1": torch.randn(6, generator=g),
        "w2": torch.randn(6, 4, generator=g),
    }
    x = torch.randn(9, 4, generator=g)
    for early, expected in (("1", [1, 0]), ("0", [2])):
        monkeypatch.setenv("PETFUNC_EARLY_ADDMM_SPLIT", early)
        seen.clear()
        compiled = petfunc.compile(fn, params, x, options={"fx_graph_cache": False})
        result, codes = run_and_get_code(lambda: compiled(params, x))
        torch.testing.assert_close(result, fn(params, x), rtol=1e-5, atol=1e-5)
        assert "addmm" not in "\n".join(codes)
        # early: the linear's addmm is split before inductor and the post-grad pass
        # sees none; late: inductor has merged the residual sum too, and the
        # post-grad pass splits both
        assert seen == expected, (early, seen)


def test_fusion_pair_attempts_reach_the_backend(monkeypatch):
    """On CPU the backend compiles with petfunc's 16 fusion partners per buffer
    (inductor ships 64), the environment's number, or the caller's option."""
    seen = []

    def backend(graph, example_inputs):
        seen.append(torch._inductor.config.max_fusion_buffer_group_pairwise_attempts)
        return graph

    def fn(x):
        return torch.tanh(x).sum(-1)

    x = torch.randn(5, 3)
    own = {"max_fusion_buffer_group_pairwise_attempts": 4}
    for env, options, expected in ((None, None, 16), ("64", None, 64), ("64", own, 4)):
        if env is None:
            monkeypatch.delenv("PETFUNC_FUSION_PAIR_ATTEMPTS", raising=False)
        else:
            monkeypatch.setenv("PETFUNC_FUSION_PAIR_ATTEMPTS", env)
        compiled = petfunc.compile(fn, x, static_argnums=(), backend=backend, options=options)
        torch.testing.assert_close(compiled(x), fn(x))
        assert seen[-1] == expected
    assert torch._inductor.config.max_fusion_buffer_group_pairwise_attempts == 64  # restored


def test_kernel_opt_level_reaches_gxx(tmp_path, monkeypatch):
    """Inductor's C++ kernels are built at inductor's own -O3, or at the level
    PETFUNC_KERNEL_OPT names while petfunc compiles; torch's flags are restored
    after, and a bad setting is refused by name."""
    from torch._inductor import cpp_builder

    def level():
        cflags, _ = cpp_builder._get_optimization_cflags(cpp_builder.get_cpp_compiler(), False)
        return [flag for flag in cflags if flag in ("O1", "O2", "O3")]

    seen = []

    def backend(graph, example_inputs):
        seen.append(level())
        return graph

    def fn(x):
        return torch.tanh(x).sum(-1)

    x = torch.randn(5, 3)
    for env, expected in ((None, ["O3"]), ("O2", ["O2"]), ("-O1", ["O1"])):
        if env is None:
            monkeypatch.delenv("PETFUNC_KERNEL_OPT", raising=False)
        else:
            monkeypatch.setenv("PETFUNC_KERNEL_OPT", env)
        petfunc.compile(fn, x, static_argnums=(), backend=backend)(x)
        assert seen[-1] == expected
    assert level() == ["O3"]  # restored
    monkeypatch.setenv("PETFUNC_KERNEL_OPT", "fast")
    with pytest.raises(ValueError, match="PETFUNC_KERNEL_OPT"):
        petfunc.compile(fn, x, static_argnums=(), backend=backend)(x)

    # the g++ command lines of a real inductor compile
    monkeypatch.setenv("PETFUNC_KERNEL_OPT", "O2")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    commands = []
    run = cpp_builder.run_compile_cmd

    def spy(cmd_line, cwd):
        commands.append(cmd_line)
        return run(cmd_line, cwd)

    monkeypatch.setattr(cpp_builder, "run_compile_cmd", spy)
    torch.testing.assert_close(petfunc.compile(fn, x, static_argnums=())(x), fn(x))
    kernels = [c for c in commands if ".main.cpp" in c or "main.cpp" in c]
    assert kernels and all(" -O2 " in c and " -O3 " not in c for c in kernels), commands


def test_inductor_cache_key_names_petfunc_codegen(tmp_path, monkeypatch):
    """Inductor's FX-graph cache keys a graph by the graph and inductor's config; the
    hash of petfunc's code-generation hooks enters it too (as a custom pass's uuid),
    so a graph compiled by an older petfunc is compiled again, not loaded."""
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    compile_module = sys.modules["petfunc.compile"]

    def fn(x):
        return torch.tanh(x).sum(-1)

    x = torch.randn(5, 3)

    def hits():
        before = counters["inductor"]["fxgraph_cache_hit"]
        torch.testing.assert_close(petfunc.compile(fn, x, static_argnums=())(x), fn(x))
        return counters["inductor"]["fxgraph_cache_hit"] - before

    assert hits() == 0
    assert hits() == 1  # the same petfunc: loaded from inductor's cache
    compile_module._codegen_hash.cache_clear()
    monkeypatch.setattr(compile_module, "_codegen_hash", lambda: "another petfunc")
    assert hits() == 0


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


def _accumulate_into_atoms(positions, values, index):
    """Edge values summed into their atoms (an ``index_put`` with accumulation)."""
    return torch.zeros(positions.shape[0], dtype=values.dtype).index_put(
        (index,), values.sin(), accumulate=True
    )


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
        _accumulate_into_atoms, positions, values, index, static_argnums=(), options={"fx_graph_cache": False}
    )
    for n_edges in (7, 30):
        values = torch.randn(n_edges, generator=g, dtype=torch.float64)
        index = torch.zeros(n_edges, dtype=torch.long)
        torch.testing.assert_close(
            compiled(positions, values, index),
            _accumulate_into_atoms(positions, values, index),
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

    compile_module = sys.modules["petfunc.compile"]
    seen = []

    def failing_once(graph, mode, fakes):
        seen.append(torch._inductor.config.cpp.simdlen)
        if len(seen) == 1:
            inner = _raise_from(f"/site-packages/torch/_inductor/{where}")
            raise torch._inductor.exc.InductorError(inner, None).with_traceback(inner.__traceback__) from None
        return lambda *inputs: graph(*inputs)

    monkeypatch.setattr(compile_module, "_compile_inductor_direct", failing_once)
    positions, values = torch.randn(4, 3, dtype=torch.float64), torch.randn(9, dtype=torch.float64)
    index = torch.arange(9) % 4
    compiled = petfunc.compile(
        _accumulate_into_atoms, positions, values, index, static_argnums=(), aot_autograd=False
    )
    if where == "elsewhere.py":
        with pytest.raises(torch._inductor.exc.InductorError, match="index.is_vec"):
            compiled(positions, values, index)
        assert len(seen) == 1
        return
    with pytest.warns(UserWarning, match="cpp.simdlen=1"):
        got = compiled(positions, values, index)
    torch.testing.assert_close(got, _accumulate_into_atoms(positions, values, index), rtol=1e-14, atol=1e-14)
    assert seen[1] == 1 and seen[0] != 1


def test_sizes_the_trace_fixed_are_checked():
    """A trace that read a size as a plain integer is valid for that size only (torch
    2.11's mm batching rule did that to vmapped ensembles): other sizes are refused
    with the assumption named, instead of running a graph that computes garbage.
    Relations between sizes (equal edge arrays) are checked the same way."""

    def specialised(params, positions, index):
        n = int(positions.shape[0])  # a Python int: the trace fixes the size
        return scatter_energy(params, positions, index) * n

    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    compiled = petfunc.compile(specialised, params, *example(4, 7), backend="aot_eager")
    x = example(4, 9)
    torch.testing.assert_close(compiled(params, *x), specialised(params, *x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"args\[1\]\.size\(\)\[0\] == 4"):
        compiled(params, *example(5, 9))
    with pytest.raises(ValueError, match=r"args\[1\]\.size\(\)\[0\] == 4"):
        compiled.eager_graph(params, *example(5, 9))

    def paired(params, positions, first, second):
        # first - second: the trace assumes both index arrays are equally long
        return scatter_energy(params, positions, first) * (first - second).sum()

    def pair_example(n_atoms, n_first, n_second):
        positions, first = example(n_atoms, n_first)
        return positions, first, example(n_atoms, n_second, seed=1)[1]

    compiled = petfunc.compile(paired, params, *pair_example(4, 7, 7), backend="aot_eager")
    x = pair_example(6, 11, 11)
    torch.testing.assert_close(compiled(params, *x), paired(params, *x), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match=r"args\[3\]\.size\(\)\[0\] == args\[2\]\.size\(\)\[0\]"):
        compiled(params, *pair_example(6, 11, 12))
    assert compiled.num_graphs == 1


# ---------------------------------------------------------------------------------------
# donated arguments


def momentum_step(state, positions, index):
    """A toy training step on a (params, moment) state: gradient, momentum, update."""
    params, moment = state
    grads, energy = torch.func.grad_and_value(lambda p: _energy(p, positions, index))(params)
    new_moment = {k: 0.9 * moment[k] + grads[k] for k in moment}
    new_params = {k: params[k] - 0.1 * new_moment[k] for k in params}
    return (new_params, new_moment), energy


def _packed_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "v": torch.randn(4, generator=g, dtype=torch.float64),
    }
    moment = {k: 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in params.items()}
    return (petfunc.tree.pack(params), petfunc.tree.pack(moment))


def _energy(params, positions, index):
    return scatter_energy({"w": params["w"]}, positions, index).sum() * params["v"].sum()


def _clone(state):
    return petfunc.tree.tree_map(lambda t: t.clone(), state)


def _assert_state_close(a, b):
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


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

    state = _packed_state()
    compiled = petfunc.compile(step, state, *example(4, 7), backend="aot_eager", donate_argnums=(0,))
    reference = _clone(state)
    for n_atoms, n_edges in ((4, 7), (9, 30), (6, 11), (9, 30)):
        x = example(n_atoms, n_edges, seed=n_atoms)
        buffers = [petfunc.tree.ravel(pytree.tree_leaves(part)) for part in state]
        old_leaves = pytree.tree_leaves(state)
        expected, expected_energy = step(_clone(reference), *x)
        state, energy = compiled(state, *x)
        torch.testing.assert_close(energy, expected_energy, rtol=1e-12, atol=1e-12)
        _assert_state_close(state, expected)
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
    state = _packed_state(1)
    expected, _ = momentum_step(_clone(state), *x)
    compiled = petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager", donate_argnums=(0,))
    # separate tensors, not views of one buffer
    loose = _clone(state)
    kept = _clone(loose)
    out, _ = compiled(loose, *x)
    _assert_state_close(out, expected)
    _assert_state_close(loose, kept)
    # the same buffer as parameters and moment (now overwritten: it was donated)
    twice = (state[0], state[0])
    expected_twice, _ = momentum_step(_clone(twice), *x)
    out, _ = compiled(twice, *x)
    _assert_state_close(out, expected_twice)
    assert (
        petfunc.tree.ravel(pytree.tree_leaves(out[0])).data_ptr()
        != petfunc.tree.ravel(pytree.tree_leaves(out[1])).data_ptr()
    )
    # no donation: the inputs are untouched
    state = _packed_state(1)
    plain = petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager")
    kept = _clone(state)
    out, _ = plain(state, *x)
    _assert_state_close(state, kept)
    _assert_state_close(out, expected)
    with pytest.raises(ValueError, match="static_argnums"):
        petfunc.compile(momentum_step, state, *example(4, 7), backend="aot_eager", donate_argnums=(1,))


def test_donation_survives_the_trace_cache(tmp_path, monkeypatch):
    """Which outputs go into which donated buffers is part of the cached trace, and
    donating or not are different cache entries."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    x = example(9, 30, seed=3)
    state = _packed_state(2)
    expected, _ = momentum_step(_clone(state), *x)
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
    _assert_state_close(out, expected)
    assert (
        petfunc.tree.ravel(pytree.tree_leaves(out[0])).data_ptr()
        == petfunc.tree.ravel(pytree.tree_leaves(state[0])).data_ptr()
    )


def test_donated_state_with_inductor():
    """Inductor, directly and through AOTAutograd, writes the new state into the
    donated buffers (the graph's ``copy_`` into its inputs) with the same numbers as
    the function, step after step."""
    for aot in (False, True):
        state = _packed_state(4)
        reference = _clone(state)
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
            _assert_state_close(state, reference)
            assert {petfunc.tree.ravel(pytree.tree_leaves(part)).data_ptr() for part in state} == buffers
        assert compiled.num_graphs == 1


def test_graph_traced_on_the_cpu_moves_to_another_device():
    """Inputs on one accelerator are traced as CPU tensors (torch.autograd's CUDA
    thread fails under make_fx on torch 2.11), and the graph is then moved: every
    tensor it creates (arange, zeros, eye, scalar_tensor...) and every constant it
    keeps must follow. Checked by moving a PET training step to the meta device and
    running it there: any tensor left on the CPU fails the run."""
    import importlib

    compile_module = importlib.import_module("petfunc.compile")
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 8),
        d_pet=4,
        d_node=4,
        d_head=4,
        d_feedforward=4,
        num_heads=1,
        cutoff=4.0,
        num_gnn_layers=1,
        num_attention_layers=1,
        num_neighbors_adaptive=6.0,
    )
    import ase.build

    from petfunc.data import make_batch, sample_from_atoms

    samples = []
    for k, name in enumerate(["CH3CH2OH", "H2O", "CH4", "CH3OH"]):
        atoms = ase.build.molecule(name)
        atoms.rattle(0.05, seed=k)
        sample = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        sample.energy = -float(k)
        samples.append(sample)
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=torch.float64)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 10, 0.1))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(model, optimizer, petfunc.LossWeights.make(forces=1.0, stress=0.0))
    batch = make_batch(samples[:2], config, [0.0] * 3, 1.0, dtype=torch.float64)
    compiled = petfunc.compile(step, state, batch, backend="aot_eager")

    assert compile_module._trace_device([torch.zeros(1), torch.zeros(1)]) is None
    assert compile_module._trace_device([torch.zeros(1, device="meta")]) is None
    inputs, _ = compiled._call_inputs(
        compiled._checked_tensors(
            (state, make_batch(samples[1:], config, [0.0] * 3, 1.0, dtype=torch.float64))
        )
    )
    on_meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in inputs]
    creates = [n for n in compiled.graph.graph.nodes if n.kwargs.get("device") == torch.device("cpu")]
    assert len(creates) >= 3
    with pytest.raises(RuntimeError, match="device"):
        compiled.graph(*on_meta)

    def values_on_cpu():
        return [
            n
            for n in compiled.graph.graph.nodes
            if any(
                isinstance(v, torch.Tensor) and v.device.type == "cpu"
                for v in pytree.tree_leaves(n.meta.get("val"))
            )
        ]

    assert any(n.op == "placeholder" for n in values_on_cpu())
    compile_module._move_graph(compiled.graph, torch.device("cpu"), torch.device("meta"))
    out = compiled.graph(*on_meta)
    assert out and all(t.device.type == "meta" for t in out)
    assert not any("cpu" in str(n.args) + str(n.kwargs) for n in compiled.graph.graph.nodes)
    # no trace-time values of the old device are left for a backend to read (the C++
    # wrapper takes the placeholders' as its inputs)
    assert not values_on_cpu()


class _Twice(torch.autograd.Function):
    """``2 x``, whose derivative is written with ``cat`` (as petfunc.ops.bmm's are
    written with products): under vmap, torch runs it as a vmap of the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 2 * torch.cat([g[:1], g[1:]])


def test_vmap_inside_grad_keeps_sizes_symbolic():
    """A vmap inside a differentiated function (as in a Hessian-vector loss) runs the
    backward of an autograd.Function as a vmap again, in the backward of the outer
    grad, after the function's own ``symbolic_vmap_rules`` block has exited. torch's
    C++ batching rule of ``cat`` reads sizes as integers, which fixed the data sizes
    of the trace to the example's (torch 2.12 did so with ``bmm``, in petfunc.ops.bmm's
    derivatives); petfunc.compile keeps its symbolic rules in place for the whole
    trace."""
    from torch.func import grad, vmap

    from petfunc._torch.vmap_rules import symbolic_vmap_rules

    def loss(w, x):
        def row(r):
            return torch.tanh(_Twice.apply(r * w)).square().sum()

        with symbolic_vmap_rules():
            values = vmap(row)(x)
        return values.sum()

    def fn(w, x):
        return grad(loss)(w, x)

    g = torch.Generator().manual_seed(0)

    def example(rows):
        return torch.randn(7, generator=g, dtype=torch.float64), torch.randn(
            rows, 7, generator=g, dtype=torch.float64
        )

    compiled = petfunc.compile(fn, *example(3), backend="aot_eager")
    for rows in (3, 4, 9):
        args = example(rows)
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-12, atol=1e-12)
    assert compiled.num_graphs == 1
