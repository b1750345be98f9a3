"""petfunc.compile's Compiled: one graph for every size, the backend's size guards,
the trace's size assumptions, input checks.

The backend compiles the traced graph with symbolic sizes, without Dynamo; the size
assumptions it makes become a guard checked at every call. A call that breaks them
(here: a size of 1, which torch specialises) compiles a second graph and still
gives the right numbers; a dtype or parameter shape the graph was not traced for
is refused.
"""

import pytest
import torch

import petfunc
from tests.helpers.compile_toys import example, scatter_energy


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


def test_graph_specialised_to_a_size_runs_only_for_that_size():
    """A backend may set a data size equal to a number while compiling (here a
    broadcast against a slice of length n - 1 = 1 makes n == 2). That number is in
    neither the guard expression (which takes static sizes as checked) nor the fixed
    sizes; unchecked, the graph compiled at n = 2 ran for every later n: an error at
    n = 11, a wrong value at n = 1."""

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
