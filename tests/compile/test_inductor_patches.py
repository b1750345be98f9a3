"""petfunc's speed patches of inductor (patches() of petfunc.compile): the float32
summation choice without a guard, CPU addmm split (before inductor's passes, its
merge held back), and inductor's cache key naming petfunc's code generation."""

import pytest
import torch

import petfunc
from petfunc.compile import codegen_hash, patches
from tests.helpers.compile_toys import example
from tests.helpers.patches import skip_unless_enabled


def _patch(name):
    return next(p for p in patches() if p.name == name)


def test_float_sums_of_any_length_share_the_graph():
    """Inductor's C++ backend sums float32 reductions longer than 4096 elements with
    a cascade helper and guarded the length on the example's side of 4096: a graph
    compiled on a small batch recompiled for a large one (only when its kernels were
    not already in inductor's cache). The choice is now made without a guard."""
    skip_unless_enabled("unguarded_sum_helper")

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
    skip_unless_enabled("addmm_merge_hold")
    from torch._inductor.fx_passes import post_grad
    from torch._inductor.utils import run_and_get_code

    if not all(hasattr(post_grad, f) for f in ("should_prefer_unfused_addmm", "is_valid_addmm_fusion")):
        pytest.skip("this torch's inductor has no merge check to hold back")
    addmm = _patch("addmm_split").module
    seen = []  # addmm nodes in each graph the split runs on: before inductor, then post-grad
    split = addmm.split_cpu_addmm

    def counting(graph):
        seen.append(sum(n.target is torch.ops.aten.addmm.default for n in graph.nodes))
        split(graph)

    monkeypatch.setattr(addmm, "split_cpu_addmm", counting)

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
        result, codes = run_and_get_code(compiled, params, x)
        torch.testing.assert_close(result, fn(params, x), rtol=1e-5, atol=1e-5)
        assert "addmm" not in "\n".join(codes)
        # early: the linear's addmm is split before inductor and the post-grad pass
        # sees none; late: inductor has merged the residual sum too, and the
        # post-grad pass splits both
        assert seen == expected, (early, seen)


def test_inductor_cache_key_names_petfunc_codegen(tmp_path, monkeypatch):
    """Inductor's FX-graph cache keys a graph by the graph and inductor's config; the
    hash of petfunc's code-generation hooks enters it too (as a custom pass's uuid),
    so a graph compiled by an older petfunc is compiled again, not loaded; so is one
    compiled with other patches of petfunc's on."""
    skip_unless_enabled("addmm_split")
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    addmm = _patch("addmm_split").module

    def fn(x):
        return torch.tanh(x).sum(-1)

    x = torch.randn(5, 3)

    def hits():
        before = counters["inductor"]["fxgraph_cache_hit"]
        torch.testing.assert_close(petfunc.compile(fn, x, static_argnums=())(x), fn(x))
        return counters["inductor"]["fxgraph_cache_hit"] - before

    assert hits() == 0
    assert hits() == 1  # the same petfunc: loaded from inductor's cache
    monkeypatch.setenv("PETFUNC_PATCHES_OFF", "fast_strides")
    assert hits() == 0  # another set of patches
    monkeypatch.delenv("PETFUNC_PATCHES_OFF")
    assert hits() == 1
    uuids = []

    def backend(graph, example_inputs):
        uuids.append(torch._inductor.config.post_grad_custom_post_pass.uuid())
        return graph

    petfunc.compile(fn, x, static_argnums=(), backend=backend)(x)
    assert codegen_hash() in uuids[-1]
    monkeypatch.setattr(addmm, "codegen_hash", lambda: "another petfunc")
    assert hits() == 0
