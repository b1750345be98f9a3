"""The kernel_groups patch (patches() of petfunc.compile): inductor's C++ kernels built a
few per library.

The grouped library must call every kernel with its own arguments (pointers, sizes,
floats), and the whole compiled function must give the numbers it gives when
inductor builds each kernel alone.
"""

import pytest
import torch

import petfunc
from tests.helpers.patches import patch, skip_unless_enabled


kernel_groups = patch("kernel_groups").module


SCALE = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const float* in_ptr0,
                       float* out_ptr0,
                       const int64_t ks0,
                       const float s0)
{
    for (int64_t i = 0; i < ks0; ++i) { out_ptr0[i] = s0 * in_ptr0[i]; }
}
"""

SHIFT = """#include <torch/csrc/inductor/cpp_prefix.h>
extern "C"  void  kernel(const double* in_ptr0,
                       double* out_ptr0,
                       const int64_t ks0)
{
    for (int64_t i = 0; i < ks0; ++i) { out_ptr0[i] = in_ptr0[i] + static_cast<double>(i); }
}
"""


def test_only_plain_kernels_are_grouped():
    assert kernel_groups.groupable(["const float*", "float*", "const int64_t", "const float"], SCALE)
    # something else at file scope (a helper, a global) could clash with another kernel's
    helper = SCALE.replace('extern "C"', 'static int helper() { return 1; }\nextern "C"')
    assert not kernel_groups.groupable(["const float*", "float*", "const int64_t", "const float"], helper)
    assert not kernel_groups.groupable(["const float*"], SCALE + SCALE)  # two entry points
    assert not kernel_groups.groupable(["at::Tensor"], SCALE)  # an argument parse_arg cannot convert
    source = kernel_groups.group_source(
        [
            (["const float*", "float*", "const int64_t", "const float"], SCALE),
            (["const double*", "double*", "const int64_t"], SHIFT),
        ]
    )
    assert source.count('extern "C" void kernel_0(') == 1 and source.count('extern "C" void kernel_1(') == 1
    assert "petfunc_arg<float>(args, 3)" in source and "petfunc_arg<double*>(args, 1)" in source


def test_grouped_library_calls_each_kernel_with_its_arguments():
    # built with inductor's flags and precompiled header, loaded as inductor loads
    # its own kernels (a few seconds: one g++ run)
    library = kernel_groups.code_cache().load(
        kernel_groups.group_source(
            [
                (["const float*", "float*", "const int64_t", "const float"], SCALE),
                (["const double*", "double*", "const int64_t"], SHIFT),
            ]
        )
    )
    x = torch.arange(5, dtype=torch.float32)
    out = torch.empty_like(x)
    library.kernel_0(x, out, 5, 2.5)
    assert torch.equal(out, 2.5 * x)
    y = torch.linspace(0, 1, 7, dtype=torch.float64)
    out = torch.empty_like(y)
    library.kernel_1(y, out, 7)
    assert torch.equal(out, y + torch.arange(7, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="kernel_1 takes a tuple of 3 arguments"):
        library.kernel_1(y, out)


def _energy(params, positions, index):
    hidden = torch.tanh(positions[index] @ params["w"]) * torch.sigmoid(positions[index, :1])
    out = torch.zeros(positions.shape[0], hidden.shape[1], dtype=positions.dtype)
    return out.index_add(0, index, hidden).pow(2).sum(1).softmax(0)


@pytest.mark.slow
def test_grouped_compile_equals_separate_kernels(tmp_path, monkeypatch):
    skip_unless_enabled("kernel_groups")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    g = torch.Generator().manual_seed(0)
    params = {"w": torch.randn(3, 6, generator=g, dtype=torch.float64)}
    args = [
        (torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, n, (e,), generator=g))
        for n, e in [(5, 17), (11, 40)]
    ]
    results = {}
    for grouped in ("1", "0"):
        monkeypatch.setenv("PETFUNC_GROUP_KERNELS", grouped)
        before = len(kernel_groups.code_cache().cache)
        compiled = petfunc.compile(_energy, params, *args[0], backend="inductor")
        results[grouped] = [compiled(params, *a) for a in args]
        built = len(kernel_groups.code_cache().cache) - before
        assert (built > 0) == (grouped == "1")
    for a, grouped, separate in zip(args, results["1"], results["0"]):
        assert torch.equal(grouped, separate)
        assert torch.allclose(grouped, _energy(params, *a), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_a_group_that_fails_to_build_falls_back_to_single_kernels(tmp_path, monkeypatch):
    skip_unless_enabled("kernel_groups")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kernel_groups, "group_source", lambda kernels: "this is not C++;\n")
    g = torch.Generator().manual_seed(1)
    params = {"w": torch.randn(3, 5, generator=g, dtype=torch.float64)}
    positions, index = (
        torch.randn(7, 3, generator=g, dtype=torch.float64),
        torch.randint(0, 7, (19,), generator=g),
    )
    with pytest.warns(RuntimeWarning, match="building this one alone"):
        compiled = petfunc.compile(_energy, params, positions, index, backend="inductor")
        out = compiled(params, positions, index)
    assert torch.allclose(out, _energy(params, positions, index), rtol=1e-12, atol=1e-14)


def test_a_group_that_cannot_be_set_up_falls_back(monkeypatch):
    # the grouped build is set up when the compiled module waits for its kernels; if
    # that fails (another torch's internals), every kernel is built alone, as inductor
    # would, with a warning
    class Owner:
        pass

    owner = Owner()
    built_alone = []

    def alone(owner_, argtypes, source):
        built_alone.append(source)
        return lambda *args: "alone"

    pending = [kernel_groups.Pending(owner, ["float*"], SCALE, alone)]
    owner._petfunc_pending = list(pending)

    def broken():
        raise TypeError("load_async() got an unexpected keyword argument")

    monkeypatch.setattr(kernel_groups, "code_cache", broken)
    monkeypatch.setattr("torch._inductor.async_compile.get_compile_threads", lambda: 1)
    kernel_groups.build(owner)
    with pytest.warns(RuntimeWarning, match="unexpected keyword argument"):
        assert pending[0](1, 2) == "alone"
    assert built_alone == [SCALE]


def test_groups_start_while_code_is_generated(monkeypatch):
    """Each kernel definition of inductor's code generation joins the open group; a
    full group starts building at once, and the module's kernels later find it. The
    cut is the same whether the kernels come from code generation or from a loaded
    module, so a warm start finds the same libraries."""
    started = []

    def start(group):
        started.append([k.source for k in group])
        return {(tuple(k.argtypes), k.source): (lambda: "built") for k in group}

    monkeypatch.setattr(kernel_groups, "start", start)
    monkeypatch.setattr(kernel_groups, "GROUP_CHARS", len(SCALE) + len(SHIFT))
    monkeypatch.setattr(kernel_groups, "defined", [])
    monkeypatch.setattr(kernel_groups, "started", {})
    for argtypes, source in (
        (["const float*", "float*", "const int64_t", "const float"], SCALE),
        (["const double*", "double*", "const int64_t"], SHIFT),
        (["const double*", "double*", "const int64_t"], SHIFT + "// another\n"),
    ):
        # what inductor's C++ scheduling passes to the wrapper's define_kernel
        kernel_groups.on_definition(f"async_compile.cpp_pybinding({argtypes!r}, r'''\n{source}\n''')\n")
    kernel_groups.on_definition("some_triton_kernel = async_compile.triton(...)")  # ignored
    assert started == [["\n" + SCALE + "\n", "\n" + SHIFT + "\n"]]  # full once past GROUP_CHARS
    assert len(kernel_groups.defined) == 1  # the open group

    class Owner:
        pass

    owner = Owner()
    owner._petfunc_pending = [
        kernel_groups.Pending(owner, a, "\n" + s + "\n", None)
        for a, s in (
            (["const float*", "float*", "const int64_t", "const float"], SCALE),
            (["const double*", "double*", "const int64_t"], SHIFT),
            (["const double*", "double*", "const int64_t"], SHIFT + "// another\n"),
        )
    ]
    pending = list(owner._petfunc_pending)
    kernel_groups.build(owner)
    assert [p._load() for p in pending] == ["built"] * 3
    assert len(started) == 2 and started[1] == ["\n" + SHIFT + "// another\n\n"]  # the last, partial group
    assert kernel_groups.started == {} and kernel_groups.defined == []
    # a module loaded from the cache (no code generation) cuts the same groups
    groups, last = kernel_groups.groups(pending)
    assert [[p.source for p in g] for g in groups + [last]] == started
