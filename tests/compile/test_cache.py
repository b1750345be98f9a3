"""The trace cache of petfunc.compile (petfunc.compile.cache): a second process with
the same key loads the traced graph instead of tracing; other keys, signatures or a
damaged file trace again."""

import os
import warnings

import pytest
import torch

import petfunc
from tests.helpers.compile_toys import example, scatter_energy


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
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))

    def failing_fsync(fd):
        raise OSError("disk full")

    monkeypatch.setattr(os, "fsync", failing_fsync)  # the atomic write fsyncs the file
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


def test_a_damaged_trace_is_never_unpickled(tmp_path, monkeypatch):
    """A flipped bit in a cached trace fails its SHA-256: warned of and traced again,
    never loaded."""
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    params = {"w": torch.randn(3, 5, dtype=torch.float64)}
    x = example(4, 7)
    petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    (path,) = tmp_path.glob("*.fx.pkl")
    data = bytearray(path.read_bytes())
    at = data.rindex(b"output")  # the name of the graph's output node
    data[at] ^= 0x01  # "output" -> "nutput": a pickle that still loads
    path.write_bytes(bytes(data))
    with pytest.warns(UserWarning, match="damaged"):
        again = petfunc.compile(scatter_energy, params, *x, backend="aot_eager", cache_key="toy")
    assert not again.from_cache
    torch.testing.assert_close(again(params, *x), scatter_energy(params, *x), rtol=1e-12, atol=1e-12)
