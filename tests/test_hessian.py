"""Hessians and Hessian-vector products of PET (and of the toy model, compiled)."""

import dataclasses
import importlib

import ase
import ase.build
import numpy as np
import pytest
import torch

import petfunc
from petfunc.hessian import chunked_hessian, hessian, hessian_rows, hvp, mass_weighted, structure_blocks
from tests.helpers import toy
from tests.helpers.patches import needs_patches


F64 = torch.float64
TINY = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8),
    d_pet=4,
    d_node=8,
    d_head=4,
    d_feedforward=4,
    num_heads=2,
    cutoff=4.0,
    num_gnn_layers=2,
    num_attention_layers=1,
)
MINI = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8),
    d_pet=4,
    d_node=4,
    d_head=4,
    d_feedforward=4,
    num_heads=1,
    cutoff=4.0,
    num_gnn_layers=1,
    num_attention_layers=1,
    activation="SiLU",
)


def _molecule(name="CH3CH2OH", seed=1):
    atoms = ase.build.molecule(name)
    atoms.rattle(0.05, seed=seed)
    return atoms


def _cell(seed=2):
    atoms = ase.build.bulk("C", "diamond", a=3.57)
    atoms.rattle(0.05, seed=seed)
    return atoms


def _setup(frames, config=TINY, seed=0):
    model = petfunc.PET(config)
    params = model.init(seed=seed, dtype=F64)
    positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=F64)
    return model.energy, params, (positions, cell, neighbors)


def _matrix(h):
    n = h.shape[0]
    return h.reshape(3 * n, 3 * n)


def _rel(a, b):
    return float((a - b).abs().max() / b.abs().max())


ADAPTIVE = dataclasses.replace(TINY, cutoff=5.0, num_neighbors_adaptive=4.0)  # the solver method


@needs_patches("layer_norm_decomposition")
@pytest.mark.parametrize("config", [TINY, ADAPTIVE], ids=["fixed", "adaptive"])
@pytest.mark.parametrize("frames", [[_molecule("CH3OH")], [_cell()]], ids=["molecule", "periodic"])
def test_hessian_matches_finite_differences_of_forces(frames, config):
    # adaptive: the radii's second derivative enters (the solver's last step must get
    # it right, not only the first: 13 % off on CH3OH otherwise)
    energy_fn, params, (x, cell, nbrs) = _setup(frames, config)
    h = _matrix(hessian(energy_fn)(params, x, cell, nbrs))
    forces = petfunc.forces(energy_fn)
    n, step = x.shape[0], 1e-5
    numeric = torch.zeros_like(h)
    for k in range(3 * n):
        d = torch.zeros(3 * n, dtype=F64)
        d[k] = step
        d = d.reshape(n, 3)
        plus, minus = forces(params, x + d, cell, nbrs), forces(params, x - d, cell, nbrs)
        numeric[k] = -(plus - minus).reshape(-1) / (2 * step)
    err = _rel(h, numeric)
    assert err < 1e-6, f"Hessian vs central differences of forces: relative error {err:.1e}"


@needs_patches("layer_norm_decomposition")
@pytest.mark.parametrize("mode", ["reverse", "forward"])
def test_symmetry_sum_rule_hvp_and_chunks(mode):
    energy_fn, params, (x, cell, nbrs) = _setup([_molecule()])
    n = x.shape[0]
    full = hessian(energy_fn, mode=mode)(params, x, cell, nbrs)
    h = _matrix(full)
    scale = float(h.abs().max())
    # symmetric
    assert float((h - h.T).abs().max()) < 1e-12 * scale
    # translation sum rule: moving every atom by the same vector changes no force
    assert float(full.sum(dim=2).abs().max()) < 1e-12 * scale
    assert float(full.sum(dim=0).abs().max()) < 1e-12 * scale
    # HVP == H @ v
    v = torch.randn(n, 3, dtype=F64, generator=torch.Generator().manual_seed(0))
    hv = hvp(energy_fn, mode=mode)(params, x, cell, nbrs, v)
    assert float((hv.reshape(-1) - h @ v.reshape(-1)).abs().max()) < 1e-12 * scale
    # chunked == full, with a ragged last chunk
    for k in (4, 7):
        chunked = hessian(energy_fn, chunk_size=k, mode=mode)(params, x, cell, nbrs)
        assert float((chunked - full).abs().max()) < 1e-13 * scale, f"chunk_size={k}"
    # both modes agree
    other = hessian(energy_fn, mode="forward" if mode == "reverse" else "reverse")(params, x, cell, nbrs)
    assert float((other - full).abs().max()) < 1e-12 * scale


@needs_patches("layer_norm_decomposition")
def test_batch_hessian_is_block_diagonal():
    frames = [_molecule("CH3CH2OH", 1), _molecule("H2O", 3), _cell()]
    energy_fn, params, (x, cell, nbrs) = _setup(frames)
    full = hessian(energy_fn)(params, x, cell, nbrs)
    blocks = structure_blocks(full, nbrs.structure_index)
    start = 0
    for atoms, block in zip(frames, blocks):
        _, _, single = _setup([atoms])
        ref = hessian(energy_fn)(params, *single)
        assert block.shape == ref.shape
        torch.testing.assert_close(block, ref, rtol=1e-10, atol=1e-12)
        stop = start + len(atoms)
        # no coupling to atoms of other structures: exactly zero
        assert torch.count_nonzero(full[start:stop, :, :start]) == 0
        assert torch.count_nonzero(full[start:stop, :, stop:]) == 0
        start = stop


def test_working_memory_is_quiet(capfd):
    """Measuring memory on CPU (torch's profiler) has Kineto print "USDT: ...
    profiler_start" / "profiler_stop" lines to stderr at every call; they are held
    back, and anything else written to stderr meanwhile still shows."""
    import os

    from petfunc.hessian import working_memory

    def fn():
        os.write(2, b"a line from inside the measured call\n")
        return torch.ones(1000, dtype=F64).cumsum(0)

    assert working_memory(fn) >= 8000
    err = capfd.readouterr().err
    assert "profiler_start" not in err and "profiler_stop" not in err, err
    assert "a line from inside the measured call" in err


def test_working_memory_inside_a_profile_is_an_error():
    """A nested profiler would end the caller's profile (losing its events) and
    measure 0 bytes: inside a running profile the measurement is refused."""
    from torch.profiler import ProfilerActivity, profile

    from petfunc.hessian import working_memory

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.ones(100, dtype=F64).cumsum(0)
        with pytest.raises(RuntimeError, match="a profiler is already running"):
            working_memory(lambda: torch.ones(1000, dtype=F64).cumsum(0))
        torch.ones(100, dtype=F64).cumsum(0)
    assert sum(e.name == "aten::cumsum" for e in prof.events()) == 2


@needs_patches("layer_norm_decomposition")
def test_memory_budget_picks_the_chunk_size(monkeypatch):
    """The budgeted Hessian equals the full one; the chosen chunk grows with the
    budget, its measured memory stays within it, the 4 measured rows are not
    computed again, and a budget too small for two rows is refused with the sizes in
    the message."""
    hessian_module = importlib.import_module("petfunc.hessian")  # petfunc.hessian is the function
    from petfunc.hessian import chunk_size_for, working_memory

    energy_fn, params, (x, cell, nbrs) = _setup([_molecule()])
    n = x.shape[0]
    rows = hessian_rows(energy_fn)
    full = hessian(energy_fn)(params, x, cell, nbrs)
    two = working_memory(rows, params, x, cell, nbrs, torch.zeros(2, n, 3, dtype=F64))
    six = working_memory(rows, params, x, cell, nbrs, torch.zeros(6, n, 3, dtype=F64))
    assert six > two > 0  # more rows, more memory: the measurement sees the pass
    matrix = 9 * n * n * 8
    budget = matrix + six + (six - two) // 8  # room for about 6 rows
    k = chunk_size_for(rows, params, x, cell, nbrs, budget)
    assert 4 <= k <= 8, k
    assert chunk_size_for(rows, params, x, cell, nbrs, 100 * budget) == 3 * n
    calls = []

    def counting_rows(fn, mode="reverse"):
        inner = hessian_rows(fn, mode)

        def rows_fn(params, positions, cell, neighbors, directions):
            calls.append(directions.shape[0])
            return inner(params, positions, cell, neighbors, directions)

        return rows_fn

    monkeypatch.setattr(hessian_module, "hessian_rows", counting_rows)
    budgeted = hessian(energy_fn, memory_budget=budget)(params, x, cell, nbrs)
    assert float((budgeted - full).abs().max()) <= 1e-13 * float(full.abs().max())
    assert calls[:2] == [2, 4] and set(calls[2:]) == {k}
    assert sum(calls) == 2 + 4 + -(-(3 * n - 4) // k) * k  # rows 0-3 only once
    one_atom = _setup([ase.Atoms("C", positions=[[0.1, 0.2, 0.3]], cell=np.eye(3) * 2.6, pbc=True)])
    assert torch.allclose(
        hessian(energy_fn, memory_budget=100 * budget)(params, *one_atom[2]),
        hessian(energy_fn)(params, *one_atom[2]),
        rtol=1e-12,
        atol=1e-14,
    )
    with pytest.raises(ValueError, match=r"memory_budget 0.0 MiB is too small for the Hessian of \d+ atoms"):
        hessian(energy_fn, memory_budget=1000)(params, x, cell, nbrs)
    with pytest.raises(ValueError, match="chunk_size or memory_budget"):
        hessian(energy_fn, chunk_size=4, memory_budget=budget)


def test_mass_weighting():
    h = torch.randn(2, 3, 2, 3, dtype=F64)
    masses = torch.tensor([1.0, 4.0], dtype=F64)
    mw = mass_weighted(h, masses)
    assert torch.allclose(mw[0:3, 3:6], h[0, :, 1, :] / 2.0)
    assert torch.allclose(mw[3:6, 3:6], h[1, :, 1, :] / 4.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="mode"):
        hessian(toy.energy, mode="sideways")
    with pytest.raises(ValueError, match="chunk_size"):
        hessian(toy.energy, chunk_size=1)
    energy_fn, params, (x, cell, nbrs) = _setup([_molecule()])
    with pytest.raises(ValueError, match=r"v must have the shape of positions \[9, 3\], got \[3\]"):
        hvp(energy_fn)(params, x, cell, nbrs, torch.ones(3, dtype=F64))


# ---------------------------------------------------------------------------------------
# compiled: one graph for every system size


SIZES = [["CH3CH2OH", "CH4"], ["H2O", "NH3"], ["CH3CH2OH", "C2H6", "CH3OH"]]


def _frames(names, seed=0):
    return [_molecule(name, seed + i) for i, name in enumerate(names)]


def _check_compiled_hessian(energy_fn, params, config, backend, chunk_size=4, with_hvp=True):
    """Compile the full Hessian, its row function (chunked) and the HVP; compare on SIZES."""
    inputs = [petfunc.from_atoms(_frames(names, i), config, dtype=F64) for i, names in enumerate(SIZES)]
    x0, cell0, nbrs0 = inputs[0]
    full = petfunc.compile(hessian(energy_fn), params, x0, cell0, nbrs0, backend=backend)
    directions = torch.zeros(chunk_size, x0.shape[0], 3, dtype=F64)
    rows = petfunc.compile(hessian_rows(energy_fn), params, x0, cell0, nbrs0, directions, backend=backend)
    chunked = chunked_hessian(rows, chunk_size)
    compiled = [full, rows]
    if with_hvp:
        products = petfunc.compile(
            hvp(energy_fn), params, x0, cell0, nbrs0, torch.zeros_like(x0), backend=backend
        )
        compiled.append(products)
    worst = 0.0
    for x, cell, nbrs in inputs:
        ref = hessian(energy_fn)(params, x, cell, nbrs)
        worst = max(worst, _rel(full(params, x, cell, nbrs), ref), _rel(chunked(params, x, cell, nbrs), ref))
        if with_hvp:
            v = torch.randn_like(x)
            worst = max(
                worst, _rel(products(params, x, cell, nbrs, v), hvp(energy_fn)(params, x, cell, nbrs, v))
            )
    assert worst < 1e-9, f"compiled Hessian: relative error {worst:.1e}"
    graphs = [c.num_graphs for c in compiled]
    assert graphs == [1] * len(compiled), f"graphs compiled: {graphs}"
    return worst


@needs_patches("layer_norm_decomposition")
def test_compiled_toy_hessian_aot_eager():
    _check_compiled_hessian(toy.energy, toy.init(), MINI, "aot_eager", with_hvp=False)


@needs_patches("layer_norm_decomposition")
@pytest.mark.slow
def test_compiled_toy_hvp_aot_eager():
    _check_compiled_hessian(toy.energy, toy.init(), MINI, "aot_eager")


@needs_patches("layer_norm_decomposition")
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_pet_hessian(backend):
    # d_head >= 32: with a narrower readout, inductor's CPU mm decomposition guards on
    # n + d_head <= 32 for the outer-product backward of the last Linear(d_head, 1)
    # and recompiles for small molecules (a test-size artefact: PET's d_head is 128)
    config = dataclasses.replace(MINI, d_head=32)
    model = petfunc.PET(config)
    worst = _check_compiled_hessian(model.energy, model.init(seed=0, dtype=F64), config, backend)
    print(f"PET Hessian {backend}: max relative error {worst:.1e}")


@needs_patches("layer_norm_decomposition")
def test_parameter_gradient_of_hvp_and_hessian():
    """A hand-written Hessian-matching loss differentiates the HVP once more, in the
    parameters: a third derivative of the layers, layer norm included (PyTorch's own
    third derivative of layer norm is wrong: 19 % off in reverse mode)."""
    config = dataclasses.replace(TINY, featurizer_type="feedforward", normalization="LayerNorm")
    energy_fn, params, (x, cell, nbrs) = _setup([_molecule("H2O")], config)
    generator = torch.Generator().manual_seed(0)
    v = torch.randn(x.shape, dtype=F64, generator=generator)
    flat = petfunc.tree.flatten(params)
    direction = {k: torch.randn(t.shape, dtype=F64, generator=generator) for k, t in flat.items()}

    def moved(t):
        return petfunc.tree.unflatten({k: flat[k] + t * direction[k] for k in flat})

    losses = {
        "hvp reverse": lambda p: (hvp(energy_fn)(p, x, cell, nbrs, v) ** 2).sum(),
        "hvp forward": lambda p: (hvp(energy_fn, mode="forward")(p, x, cell, nbrs, v) ** 2).sum(),
        "hessian": lambda p: (hessian(energy_fn)(p, x, cell, nbrs) ** 2).sum(),
    }

    # the same HVP written with plain torch.func, outside petfunc.hessian: right too,
    # as layer norm decomposes itself under such transforms (PyTorch's own: 1-2 % off)
    def gradient(p):
        return torch.func.grad(lambda y: energy_fn(p, y, cell, nbrs).sum())

    losses["torch.func jvp(grad)"] = lambda p: (torch.func.jvp(gradient(p), (x,), (v,))[1] ** 2).sum()
    losses["torch.func vjp(grad)"] = lambda p: (torch.func.vjp(gradient(p), x)[1](v)[0] ** 2).sum()
    losses["torch.func jacfwd(jacfwd)"] = lambda p: (
        torch.func.jacfwd(torch.func.jacfwd(lambda y: energy_fn(p, y, cell, nbrs).sum()))(x) ** 2
    ).sum()
    for name, loss in losses.items():
        g = petfunc.tree.flatten(torch.func.grad(loss)(params))
        analytic = sum((g[k] * direction[k]).sum() for k in g)
        step = 1e-5
        numeric = (loss(moved(step)) - loss(moved(-step))) / (2 * step)
        err = float(abs(analytic - numeric) / abs(numeric))
        assert err < 1e-6, f"{name}: parameter gradient vs central difference {err:.1e}"


@needs_patches("layer_norm_decomposition")
def test_top_level_spelling():
    """``petfunc.hessian(energy_fn)`` (the module is callable) and ``petfunc.hvp``."""
    energy_fn, params, inputs = _setup([_molecule("H2O")])
    assert torch.equal(petfunc.hessian(energy_fn)(params, *inputs), hessian(energy_fn)(params, *inputs))
    chunked = hessian(energy_fn, chunk_size=2)(params, *inputs)
    assert torch.equal(petfunc.hessian(energy_fn, chunk_size=2)(params, *inputs), chunked)
    v = torch.ones_like(inputs[0])
    assert torch.equal(petfunc.hvp(energy_fn)(params, *inputs, v), hvp(energy_fn)(params, *inputs, v))
    # the module keeps its other names for imports; the package name is the function
    assert (
        petfunc.hessian is hessian
        and importlib.import_module("petfunc.hessian").mass_weighted is mass_weighted
    )
    # the README's modules are attributes of the package after `import petfunc`
    for name in ("ensemble", "hessian_loss", "export", "llpr", "lora", "relax", "dynamics"):
        assert hasattr(petfunc, name), name


@needs_patches("layer_norm_decomposition")
def test_isolated_atom_is_quiet():
    """A structure without edges normalises no tokens: the decomposed layer norm gives
    the right result (zero) without warning "var_mean(): degrees of freedom is <= 0"
    at every Hessian."""
    import warnings

    energy_fn, params, inputs = _setup([ase.Atoms("O")])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(hessian(energy_fn)(params, *inputs), torch.zeros(1, 3, 1, 3, dtype=F64))
