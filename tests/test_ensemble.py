"""Ensembles by vmap: equal to K single models, eager, traced and compiled.

The traced/compiled checks are the point of petfunc.ensemble: PyTorch's own vmap
rules under make_fx bake the trace batch's sizes into the graph, and vmap under
inductor can miscompile index operations into expanded tensors. Every check runs
several batch shapes through one graph and compares with K separate eager
single-model evaluations or training steps, in float64.
"""

import dataclasses
import warnings

import pytest
import torch

import petfunc
import petfunc.ensemble as ensemble
from tests.helpers import toy
from tests.helpers.patches import needs_patches


F64 = torch.float64
RTOL = 1e-9

# two GNN layers, a node stream wider than the edges, SwiGLU: every PET code path
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
# the smallest PET, for traced and compiled checks (their cost grows with the graph)
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
SHAPES = [(3, 0), (2, 1), (5, 2)]  # (structures, seed): different atom/edge/width counts


def _rel(a, b):
    """Max relative error, NaN patterns must agree."""
    nan = torch.isnan(b)
    assert torch.equal(nan, torch.isnan(a)), "NaN patterns differ"
    a, b = a[~nan], b[~nan]
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)) if b.numel() else 0.0


def _assert_trees_close(out, ref, rtol=RTOL, what=""):
    out_leaves, out_spec = petfunc.tree.tree_flatten(out)
    ref_leaves, ref_spec = petfunc.tree.tree_flatten(ref)
    assert out_spec == ref_spec, f"{what}: tree structures differ"
    worst = 0.0
    for a, b in zip(out_leaves, ref_leaves):
        assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        if a.is_floating_point():
            worst = max(worst, _rel(a, b))
        else:
            assert torch.equal(a, b), f"{what}: integer leaves differ"
    assert worst < rtol, f"{what}: max relative error {worst:.2e} >= {rtol}"
    return worst


def _stack(trees):
    return petfunc.tree.tree_map(lambda *xs: torch.stack(xs), *trees)


def _members_efs(energy_fn, params, batch):
    efs = petfunc.energy_forces_stress(energy_fn)
    outs = [efs(p, batch.positions, batch.cell, batch.neighbors) for p in petfunc.tree.unstack(params)]
    return tuple(torch.stack([o[i] for o in outs]) for i in range(3))


def _members_step(step, state, batch):
    k = ensemble.size(state.params)
    outs = [step(ensemble.member_state(state, i), batch) for i in range(k)]
    return _stack([o[0] for o in outs]), _stack([o[1] for o in outs])


# ---------------------------------------------------------------------------------------
# parameters


def test_init_stack_unstack():
    model = petfunc.PET(TINY)
    params = ensemble.init(model, seeds=[3, 4, 5], dtype=F64)
    assert ensemble.size(params) == 3
    members = petfunc.tree.unstack(params)
    for seed, member in zip([3, 4, 5], members):
        ref = model.init(seed=seed, dtype=F64)
        flat, flat_ref = petfunc.tree.flatten(member), petfunc.tree.flatten(ref)
        assert list(flat) == list(flat_ref)
        assert all(torch.equal(flat[k], flat_ref[k]) for k in flat)
    restacked = petfunc.tree.flatten(petfunc.tree.stack(members))
    assert all(torch.equal(v, petfunc.tree.flatten(params)[k]) for k, v in restacked.items())
    w = petfunc.tree.flatten(params)["gnn_layers.0.edge_embedder.weight"]
    assert not torch.equal(w[0], w[1]), "members must be initialised differently"
    with pytest.raises(ValueError, match="at least 2 members"):
        ensemble.init(model, seeds=[0])


# ---------------------------------------------------------------------------------------
# eager: vmap == K single models


def test_energy_forces_stress_equal_members():
    model = petfunc.PET(TINY)
    params = ensemble.init(model, range(3), dtype=F64)
    batch = toy.labelled_batch(TINY, 3, seed=0)
    args = (batch.positions, batch.cell, batch.neighbors)
    out = ensemble.energy_forces_stress(model.energy)(params, *args)
    ref = _members_efs(model.energy, params, batch)
    s, n = batch.n_structures, batch.positions.shape[0]
    assert [tuple(o.shape) for o in out] == [(3, s), (3, n, 3), (3, s, 3, 3)]
    _assert_trees_close(out, ref, 1e-12, "E/F/S")
    energies = ensemble.energy(model.energy)(params, *args)
    _assert_trees_close(energies, ref[0], 1e-12, "energy")


def test_committee_mean_and_std():
    model = petfunc.PET(TINY)
    params = ensemble.init(model, range(4), dtype=F64)
    batch = toy.labelled_batch(TINY, 2, seed=1)
    c = ensemble.committee(model.energy)(params, batch.positions, batch.cell, batch.neighbors)
    energies, forces, stress = c.members
    torch.testing.assert_close(c.energy, energies.mean(0))
    torch.testing.assert_close(c.forces_std, forces.std(0))
    torch.testing.assert_close(c.stress, stress.mean(0), equal_nan=True)
    assert (c.energy_std > 0).all() and (c.forces_std > 0).all()


@pytest.mark.parametrize("train", [None, petfunc.train.HEADS])
def test_train_step_equals_members(train):
    model = petfunc.PET(TINY)
    optimizer = petfunc.make_optimizer(1e-2)
    params = ensemble.init(model, range(3), dtype=F64)
    state = ensemble.init_state(params, optimizer, train)
    weights = petfunc.LossWeights.make(1.0, 10.0, 1.0)
    # clipped as petfunc train clips: unclipped, Adam's first steps g / (|g| + eps)
    # amplify round-off of tiny gradients past the tolerance
    step = petfunc.make_train_step(model, optimizer, weights, 1.0, train=train)
    ens_step = ensemble.make_train_step(model, optimizer, weights, 1.0, train=train)
    for seed in range(2):  # two steps: the optimizer state must be carried per member
        batch = toy.labelled_batch(TINY, 3, seed=seed)
        ref_state, ref_metrics = _members_step(step, state, batch)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            state, metrics = ens_step(state, batch)
        # no op of the step falls back to vmap's member-by-member loop
        assert not [str(w.message) for w in caught if "batching rule" in str(w.message)]
        _assert_trees_close((state, metrics), (ref_state, ref_metrics), 1e-12, f"step {seed}")
    assert metrics["loss"].shape == (3,)
    if train is not None:  # a committee of readouts: each member's backbone is as it was
        before, after = petfunc.tree.flatten(params), petfunc.tree.flatten(state.params)
        moved = {k for k in before if not torch.equal(before[k], after[k])}
        assert moved and all(k.startswith(train) for k in moved)


def test_member_batches():
    """One rotated copy of the batch per member: same neighbour graph, own labels."""
    model = petfunc.PET(TINY)
    optimizer = petfunc.make_optimizer(1e-2)
    state = ensemble.init_state(ensemble.init(model, range(2), dtype=F64), optimizer)
    samples = [petfunc.data.sample_from_atoms(a, TINY) for a in toy.frames(3, seed=4)]
    rotations = petfunc.data.random_rotations(2 * len(samples), torch.Generator().manual_seed(0))
    batches = [
        petfunc.make_batch(samples, TINY, [0.0] * 4, 1.0, F64, rotations=rotations[i::2]) for i in range(2)
    ]
    weights = petfunc.LossWeights.make(1.0, 10.0, 1.0)
    step = petfunc.make_train_step(model, optimizer, weights, 1.0)
    new, metrics = ensemble.make_train_step(model, optimizer, weights, 1.0, member_batches=True)(
        state, ensemble.stack_batches(batches)
    )
    for i in range(2):
        ref_state, ref_metrics = step(ensemble.member_state(state, i), batches[i])
        _assert_trees_close(
            (ensemble.member_state(new, i), {k: v[i] for k, v in metrics.items()}),
            (ref_state, ref_metrics),
            1e-12,
            f"member {i}",
        )
    other = toy.labelled_batch(TINY, 3, seed=5)
    with pytest.raises(ValueError, match="neighbour graph"):
        ensemble.stack_batches([batches[0], other])


# ---------------------------------------------------------------------------------------
# traced and compiled: one graph for every batch shape


def _check_compiled_ensemble(config_or_toy, backend, traced_only=False, train=True, efs=True):
    """Compile (or only trace) ensemble E/F/S and training step; compare on SHAPES."""
    if config_or_toy == "toy":
        config, energy_fn = MINI, toy.energy
        params = petfunc.tree.stack([toy.init(seed=s) for s in range(3)])
        train_fn = toy.energy
    else:
        config = config_or_toy
        model = petfunc.PET(config)
        energy_fn, train_fn = model.energy, model
        params = ensemble.init(model, range(3), dtype=F64)
    optimizer = petfunc.make_optimizer(1e-2)
    state = ensemble.init_state(params, optimizer)
    weights = petfunc.LossWeights.make(1.0, 10.0, 1.0)
    single_step = petfunc.make_train_step(train_fn, optimizer, weights)
    batches = [toy.labelled_batch(config, n, seed) for n, seed in SHAPES]
    b0 = batches[0]
    checks = []
    if efs:
        fn = ensemble.energy_forces_stress(energy_fn)
        compiled = petfunc.compile(fn, params, b0.positions, b0.cell, b0.neighbors, backend=backend)
        checks.append(
            (
                "E/F/S",
                compiled,
                lambda c, b: (params, b.positions, b.cell, b.neighbors),
                lambda b: _members_efs(energy_fn, params, b),
            )
        )
    if train:
        compiled = petfunc.compile(
            ensemble.make_train_step(train_fn, optimizer, weights), state, b0, backend=backend
        )
        checks.append(
            ("train step", compiled, lambda c, b: (state, b), lambda b: _members_step(single_step, state, b))
        )
    worst = {}
    for name, compiled, args, reference in checks:
        worst[name] = 0.0
        for b in batches:
            out = compiled.eager_graph(*args(compiled, b)) if traced_only else compiled(*args(compiled, b))
            what = f"{name}, {b.positions.shape[0]} atoms, {b.n_structures} structures"
            worst[name] = max(worst[name], _assert_trees_close(out, reference(b), RTOL, what))
        if not traced_only:
            assert compiled.num_graphs == 1, f"{name}: {compiled.num_graphs} graphs"
    return worst


@needs_patches("vmap_rules")
def test_traced_pet_ensemble_is_shape_generic():
    """The make_fx graph of a vmapped PET E/F/S replays every batch shape."""
    _check_compiled_ensemble(MINI, "aot_eager", traced_only=True, train=False)


@needs_patches("vmap_rules")
@pytest.mark.slow
def test_traced_pet_train_step_is_shape_generic():
    """The make_fx graph of a vmapped PET training step replays every batch shape."""
    _check_compiled_ensemble(MINI, "aot_eager", traced_only=True, efs=False)


@needs_patches("vmap_rules")
def test_compiled_toy_ensemble_aot_eager():
    _check_compiled_ensemble("toy", "aot_eager")


@needs_patches("vmap_rules")
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_pet_ensemble(backend):
    # d_head >= 32 keeps inductor's CPU mm decomposition from guarding on sizes (see
    # test_hessian.test_compiled_pet_hessian); PET's own d_head is 128
    worst = _check_compiled_ensemble(dataclasses.replace(MINI, d_head=32), backend)
    print(f"PET ensemble {backend}: max relative errors {worst}")


@needs_patches("vmap_rules")
@pytest.mark.slow
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_compiled_long_range_ensemble(backend):
    """Long-range features (Ewald for the cells, direct sums for the molecules of
    these batches) in the compiled vmap'd E/F/S and training step."""
    config = dataclasses.replace(
        MINI, d_head=32, long_range=petfunc.config.LongRangeConfig(enable=True, kspace_resolution=1.0)
    )
    assert toy.labelled_batch(config, 3, 0).neighbors.long_range.periodic.tolist() == [True, False, True]
    worst = _check_compiled_ensemble(config, backend)
    print(f"long-range PET ensemble {backend}: max relative errors {worst}")


@needs_patches("vmap_rules")
@pytest.mark.slow
def test_compiled_toy_ensemble_inductor():
    _check_compiled_ensemble("toy", "inductor")
