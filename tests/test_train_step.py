"""The pure training step: eager torch.func vs metatrain, compiled vs eager,
recompilation count, a falling loss, one-structure batches."""

import math

import ase.build
import numpy as np
import pytest
import torch
from ase.calculators.emt import EMT

import petfunc
from petfunc.data import Dataset, make_batch, sample_from_atoms


CONFIG = petfunc.PETConfig(
    atomic_types=(13, 29),
    cutoff=4.0,
    d_pet=16,
    d_node=32,
    d_head=16,
    d_feedforward=32,
    num_heads=2,
    num_gnn_layers=2,
    num_attention_layers=1,
)


def _emt_samples(n, seed, config=CONFIG):
    """Rattled Cu/Al fcc cells of 4 and 8 atoms labelled by EMT (energy, forces, stress)."""
    rng = np.random.default_rng(seed)
    samples = []
    for k in range(n):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 1 + k % 2))
        atoms.numbers[rng.random(len(atoms)) < 0.3] = 13
        atoms.rattle(0.1, seed=int(rng.integers(1 << 30)))
        atoms.calc = EMT()
        atoms.get_stress()
        samples.append(sample_from_atoms(atoms, config))
    return samples


@pytest.fixture(scope="module")
def dataset():
    return Dataset(_emt_samples(12, 0), CONFIG)


@pytest.fixture(scope="module")
def fitted(dataset):
    return dataset.fit_composition_and_scale()


def _params(fitted, seed=0, dtype=torch.float64, device="cpu", config=CONFIG):
    w, c = fitted
    params = petfunc.PET(config).init(seed=seed, dtype=dtype, device=device)
    params["composition_weights"] = torch.tensor(w, dtype=dtype, device=device)
    params["energy_scale"] = torch.tensor(c, dtype=dtype, device=device)
    return params


def _batch(dataset, fitted, index, dtype=torch.float64, device="cpu"):
    w, c = fitted
    return make_batch([dataset.samples[i] for i in index], CONFIG, w, c, dtype=dtype, device=device)


def _relative(a, b):
    """max |a - b| / max |b|, computed on the CPU (``a`` and ``b`` may be on different devices)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


# -----------------------------------------------------------------------------------
# eager torch.func gradients == metatrain's training-mode gradients


def test_parameter_gradients_match_metatrain(dataset, fitted):
    _check_gradients_against_metatrain(dataset, fitted, torch.device("cpu"))


def _check_gradients_against_metatrain(dataset, fitted, device):
    """petfunc's eager torch.func parameter gradients of the training loss (energy,
    forces, stress) on ``device`` equal metatrain's training-mode gradients computed
    there (1e-8 relative), and so do the losses (1e-12)."""
    pytest.importorskip("metatrain")
    from metatomic.torch import systems_to_torch
    from metatrain.utils.data.target_info import get_energy_target_info
    from metatrain.utils.evaluate_model import evaluate_model
    from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

    from helpers import mtt_reference as ref

    # A batch of 3 structures (no padding needed), float64, energy + forces + stress.
    params = _params(fitted, seed=3, device=device)
    batch = _batch(dataset, fitted, [0, 1, 2], device=device)
    weights = petfunc.LossWeights.make(energy=1.0, forces=2.0, stress=0.5)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(CONFIG), weights)(params, batch)

    # The same weights and structures in metatrain, train mode, its evaluate_model.
    model = ref.make_model(CONFIG)
    ref.load_params(model, torch.utils._pytree.tree_map(lambda t: t.cpu(), params))
    model = model.to(device).train()
    frames = []
    for i in range(3):
        s = dataset.samples[i].structure
        frames.append(ase.Atoms(numbers=s.numbers, positions=s.positions, cell=s.cell, pbc=s.pbc))
    systems = [
        get_system_with_neighbor_lists(s, model.requested_neighbor_lists()).to(device)
        for s in systems_to_torch(frames, dtype=torch.float64)
    ]
    info = get_energy_target_info(
        "energy", {"quantity": "energy", "unit": "eV"}, add_position_gradients=True, add_strain_gradients=True
    )
    out = evaluate_model(model, systems, {"energy": info}, is_training=True)["energy"].block()
    energy = out.values[:, 0]
    de_dx = out.gradient("positions").values[:, :, 0]
    de_deps = out.gradient("strain").values[:, :, :, 0]
    n_atoms = torch.tensor([len(f) for f in frames], dtype=torch.float64, device=device)

    # metatrain's loss (spec section 9.1), written out, on the same training-unit targets.
    loss = (
        1.0 * ((energy - batch.energy) / n_atoms).pow(2).mean()
        + 2.0 * (de_dx + batch.forces).pow(2).mean()
        + 0.5 * ((de_deps - batch.strain_derivative) / n_atoms[:, None, None]).pow(2).mean()
    )
    loss.backward()
    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * loss.item()

    ours = petfunc.tree.flatten(grads)
    checked = 0
    for name, parameter in model.named_parameters():
        key = name.removeprefix("backend.")
        if key not in ours:
            continue
        reference = parameter.grad
        assert reference is not None, name
        assert ours[key].device.type == device.type, key
        err = _relative(ours[key], reference)
        assert err < 1e-8, f"{key}: relative gradient error {err:.2e}"
        checked += 1
    assert checked == len(ours)


# -----------------------------------------------------------------------------------
# compiled == eager, one graph for every batch shape


def _warmed_up_compiled_step(dataset, fitted, device="cpu", **compile_options):
    """``(step, compiled step, state)``: the train step, its ``petfunc.compile`` (traced
    on batch [5, 6], ``compile_options`` passed on) and the state after two eager
    steps, so that the moments and the schedule are non-trivial."""
    params = _params(fitted, device=device)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 100, 0.05))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights())
    for index in ([0, 1], [2, 3, 4]):
        state, _ = step(state, _batch(dataset, fitted, index, device=device))
    compiled = petfunc.compile(step, state, _batch(dataset, fitted, [5, 6], device=device), **compile_options)
    return step, compiled, state


@pytest.fixture(scope="module")
def compiled_setup(dataset, fitted):
    return _warmed_up_compiled_step(dataset, fitted, backend="aot_eager")


# (n structures), different numbers of atoms, edges and neighbours; [9] is one structure
SHAPES = [[0, 1, 2], [3, 4, 5, 6], [7, 8], [9], [10, 11, 0, 1, 2]]


def test_compiled_step_equals_eager_on_every_shape(dataset, fitted, compiled_setup):
    _check_compiled_train_step(*compiled_setup, dataset, fitted)


def _check_compiled_train_step(step, compiled, state, dataset, fitted, device="cpu"):
    """On every batch of SHAPES (each a different size), the compiled step's metrics,
    parameter updates and optimizer moments equal the eager step's (1e-9 relative),
    on ``device``, from one compiled graph."""
    seen = set()
    for index in SHAPES:
        batch = _batch(dataset, fitted, index, device=device)
        seen.add((batch.n_structures, batch.positions.shape[0], batch.neighbors.nef_index.shape[1]))
        eager_state, eager_metrics = step(state, batch)
        new_state, metrics = compiled(state, batch)
        for key in eager_metrics:
            assert _relative(metrics[key], eager_metrics[key]) < 1e-9, key
        flat_eager = petfunc.tree.flatten(eager_state.params)
        flat_compiled = petfunc.tree.flatten(new_state.params)
        before = petfunc.tree.flatten(state.params)
        for key in flat_eager:
            assert flat_compiled[key].device == before[key].device, key
            update = flat_eager[key] - before[key]
            if update.abs().max() == 0:
                assert torch.equal(flat_compiled[key], flat_eager[key]), key
                continue
            # compare the parameter *updates*, a much stricter test than the params
            err = _relative(flat_compiled[key] - before[key], update)
            assert err < 1e-9, f"{key}: {err:.2e}"
        for a, b in zip(
            torch.utils._pytree.tree_leaves(new_state.opt_state),
            torch.utils._pytree.tree_leaves(eager_state.opt_state),
        ):
            assert _relative(a.double(), b.double()) < 1e-9
    assert len(seen) == len(SHAPES)
    assert compiled.num_graphs == 1, f"{compiled.num_graphs} graphs compiled"


def test_donated_compiled_step_trains_like_eager(dataset, fitted, compiled_setup):
    """The compiled step with its state donated (as ``petfunc train`` runs it):
    trained step after step over batches of every shape, it follows the eager step,
    and the new state lives in the buffers of the one it was given."""
    step, _, state = compiled_setup
    _check_donated_step(step, state, dataset, fitted, "aot_eager")


def _check_donated_step(step, state, dataset, fitted, backend, device="cpu"):
    reference = torch.utils._pytree.tree_map(torch.clone, state)
    state = petfunc.pack_state(torch.utils._pytree.tree_map(torch.clone, state))
    example = _batch(dataset, fitted, [5, 6], device=device)
    compiled = petfunc.compile(step, state, example, backend=backend, donate_argnums=(0,))

    def buffers(state):  # where the trained parameters and each moment live
        parts = [petfunc.train.trainable(state.params), state.opt_state.mu, state.opt_state.nu]
        return [petfunc.tree.packed_range(torch.utils._pytree.tree_leaves(p))[0].data_ptr() for p in parts]

    donated = buffers(state)
    for index in SHAPES:
        batch = _batch(dataset, fitted, index, device=device)
        before = petfunc.tree.flatten(reference.params)
        reference, eager_metrics = step(reference, batch)
        state, metrics = compiled(state, batch)
        assert _relative(metrics["loss"], eager_metrics["loss"]) < 1e-9
        flat_eager = petfunc.tree.flatten(reference.params)
        flat_compiled = petfunc.tree.flatten(state.params)
        for key in flat_eager:
            update = flat_eager[key] - before[key]
            if update.abs().max() > 0:
                assert _relative(flat_compiled[key] - before[key], update) < 1e-8, key
        assert buffers(state) == donated
    assert compiled.num_graphs == 1


def test_compiled_energy_forces_stress_and_gradients_equal_eager(dataset, fitted):
    params = _params(fitted, seed=5)
    model = petfunc.PET(CONFIG)
    grad_step = petfunc.make_grad_step(model, petfunc.LossWeights())
    efs = petfunc.energy_forces_stress(model.energy)

    def fn(params, batch):
        grads, metrics = grad_step(params, batch)
        return grads, metrics, efs(params, batch.positions, batch.cell, batch.neighbors)

    compiled = petfunc.compile(fn, params, _batch(dataset, fitted, [0, 1]), backend="aot_eager")
    for index in ([2, 3, 4], [5], [6, 7, 8, 9]):
        batch = _batch(dataset, fitted, index)
        expected = fn(params, batch)
        got = compiled(params, batch)
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            assert _relative(a[finite], b[finite]) < 1e-9
    assert compiled.num_graphs == 1


def _check_compiled_equals_eager(config, samples, params, fitted):
    """Compile (aot_eager) a grad step plus E/F/S on one batch; compare gradients,
    energies, forces and stress with eager on three other batches (1e-9); one graph."""
    w, c = fitted
    model = petfunc.PET(config)
    grad_step = petfunc.make_grad_step(model, petfunc.LossWeights())
    efs = petfunc.energy_forces_stress(model.energy)

    def fn(params, batch):
        return grad_step(params, batch), efs(params, batch.positions, batch.cell, batch.neighbors)

    def batch(index):
        return make_batch([samples[i] for i in index], config, w, c, dtype=torch.float64)

    compiled = petfunc.compile(fn, params, batch([0, 1]), backend="aot_eager")
    for index in ([2, 3, 4], [5], [6, 7, 0, 1]):
        expected = fn(params, batch(index))
        got = compiled(params, batch(index))
        for a, b in zip(torch.utils._pytree.tree_leaves(got), torch.utils._pytree.tree_leaves(expected)):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            assert _relative(a[finite], b[finite]) < 1e-9
    assert compiled.num_graphs == 1


@pytest.mark.slow  # 70 s; eager conditioning is checked against metatrain in the default run
def test_compiled_conditioned_model_equals_eager(dataset, fitted):
    """Charge/spin conditioning in the compiled graph: gradients, energies, forces
    and stress equal eager for batches of other sizes and charges; one graph."""
    import dataclasses

    config = dataclasses.replace(CONFIG, system_conditioning=True, max_charge=2, max_spin_multiplicity=3)
    samples = _emt_samples(8, 3, config)
    for k, sample in enumerate(samples):
        sample.structure.charge, sample.structure.spin_multiplicity = k % 5 - 2, 1 + k % 3
    params = _params(fitted, seed=2, config=config)
    gate = params["system_conditioning"]["project"]["2"]
    gate["weight"] = torch.randn(
        gate["weight"].shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64
    )
    _check_compiled_equals_eager(config, samples, params, fitted)
    # the charge changes the energy (the gate is not zero)
    w, c = fitted
    model = petfunc.PET(config)
    one = [samples[0]]
    neutral = model.energy(params, *make_batch(one, config, w, c, dtype=torch.float64)[:3])
    samples[0].structure.charge = 2
    charged = model.energy(params, *make_batch(one, config, w, c, dtype=torch.float64)[:3])
    assert abs(float(neutral[0] - charged[0])) > 1e-3


@pytest.mark.slow  # 115 s; the default run compiles the long-range calculator (test_long_range)
def test_compiled_long_range_model_equals_eager(fitted):
    """Long-range features in the compiled training step (Ewald, as metatrain trains):
    gradients, energies, forces and stress equal eager on batches whose k-grids,
    atoms and edges differ (the one-structure batch is padded with a molecule, so
    the direct sum runs too); one graph."""
    import dataclasses

    config = dataclasses.replace(
        CONFIG, long_range=petfunc.config.LongRangeConfig(enable=True, kspace_resolution=1.0)
    )
    samples = _emt_samples(8, 4, config)
    w, c = fitted
    shapes = {
        tuple(make_batch([samples[i] for i in index], config, w, c).neighbors.long_range.kgrid.shape)
        for index in ([0, 1], [2, 3, 4], [5], [6, 7, 0, 1])
    }
    assert len(shapes) >= 3
    _check_compiled_equals_eager(config, samples, _params(fitted, seed=2, config=config), fitted)


def test_one_structure_batch_is_padded(dataset, fitted):
    batch = _batch(dataset, fitted, [0])
    # the padding structure has no labels, so the loss only sees the real one
    assert batch.n_structures == 2
    assert torch.isnan(batch.energy[1]) and not torch.isnan(batch.energy[0])
    params = _params(fitted)
    loss_fn = petfunc.make_loss(petfunc.PET(CONFIG))
    loss_padded, _ = loss_fn(params, batch)
    unpadded = make_batch([dataset.samples[0]], CONFIG, *fitted, dtype=torch.float64, pad=False)
    loss_alone, _ = loss_fn(params, unpadded)
    assert abs(loss_padded.item() - loss_alone.item()) <= 1e-10 * loss_alone.item()


def test_batch_whose_adaptive_cutoff_keeps_no_edge_is_padded():
    """Fe3 chains with 2.3 Å bonds: every atom has neighbours within the 2.5 Å
    cutoff, the middle one two, but the (legacy grid) adaptive cutoff keeps none of
    those edges. Judged by the flat list alone, the batch would have no token and an
    empty NEF grid, and a compiled step traced on it would assume those sizes are 0
    and refuse the next batch. make_batch pads it: the loss is unchanged, and one
    graph serves both batches."""
    config = petfunc.PETConfig(
        atomic_types=(26,),
        cutoff=2.5,
        num_neighbors_adaptive=30,
        adaptive_cutoff_method="grid",
        d_pet=4,
        d_node=4,
        d_head=4,
        d_feedforward=4,
        num_heads=1,
        num_gnn_layers=1,
        num_attention_layers=1,
    )

    def chains(spacing, n):
        samples = []
        for k in range(n):
            atoms = ase.Atoms("Fe3", positions=[[0, 0, 0], [spacing, 0.1 * k, 0], [2 * spacing, 0, 0.2]])
            sample = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
            sample.energy, sample.forces = -1.0 - k, np.full((3, 3), 0.1 * (k + 1))
            samples.append(sample)
        return samples

    fitted = (np.array([-0.5]), 1.0)
    batch = make_batch(chains(2.3, 2), config, *fitted, dtype=torch.float64)
    assert batch.n_structures == 3
    assert batch.neighbors.kept_edges.shape[0] >= 2 and batch.neighbors.nef_index.shape[1] >= 2
    unpadded = make_batch(chains(2.3, 2), config, *fitted, dtype=torch.float64, pad=False)
    assert unpadded.neighbors.kept_edges.shape[0] == 0
    params = _params(fitted, config=config)
    grad_step = petfunc.make_grad_step(
        petfunc.PET(config), petfunc.LossWeights.make(energy=1.0, forces=1.0, stress=0.0)
    )
    (_, padded_metrics), (_, alone_metrics) = grad_step(params, batch), grad_step(params, unpadded)
    assert (
        abs(padded_metrics["loss"].item() - alone_metrics["loss"].item())
        <= 1e-12 * alone_metrics["loss"].item()
    )
    compiled = petfunc.compile(grad_step, params, batch, backend="aot_eager", static_argnums=(0,))
    other = make_batch(chains(2.0, 3), config, *fitted, dtype=torch.float64)
    assert other.neighbors.kept_edges.shape[0] > 0
    for b in (batch, other):
        got, expected = compiled(params, b), grad_step(params, b)
        for key, value in petfunc.tree.flatten(expected[0]).items():
            assert _relative(petfunc.tree.flatten(got[0])[key], value) < 1e-9, key
    assert compiled.num_graphs == 1


def test_loss_falls(dataset, fitted):
    params = _params(fitted, seed=1)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-2, 60, 0.05))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights())
    losses = []
    for epoch in range(30):
        total = 0.0
        for index in dataset.batch_indices(6, shuffle=True, seed=epoch):
            state, metrics = step(state, _batch(dataset, fitted, index))
            total += metrics["loss"].item()
        losses.append(total)
    assert losses[-1] < 0.5 * losses[0], losses
    # a state made for other trained parameters is refused with the reason
    heads = petfunc.make_train_step(
        petfunc.PET(CONFIG), optimizer, petfunc.LossWeights(), train=petfunc.train.HEADS
    )
    with pytest.raises(ValueError, match=r"optimizer state does not fit the trained parameters"):
        heads(state, _batch(dataset, fitted, [0]))
    # a torchopt optimizer's state made for the whole tree (the fitted composition and
    # scale included): it failed in torchopt with "The size of tensor a (2) must match"
    import torchopt

    adamw = torchopt.adamw(1e-3)
    plain = petfunc.make_train_step(petfunc.PET(CONFIG), adamw, petfunc.LossWeights())
    with pytest.raises(
        ValueError, match=r"made for every parameter, composition_weights and energy_scale included"
    ):
        plain(petfunc.TrainState(params, adamw.init(params)), _batch(dataset, fitted, [0]))
    _, metrics = plain(
        petfunc.TrainState(params, adamw.init(petfunc.train.trainable(params))), _batch(dataset, fitted, [0])
    )
    assert math.isfinite(float(metrics["loss"]))


def test_loss_skips_nan_labels_and_supports_loss_types(dataset, fitted):
    params = _params(fitted)
    model = petfunc.PET(CONFIG)
    batch = _batch(dataset, fitted, [0, 1, 2])
    forces = batch.forces.clone()
    forces[:3] = float("nan")
    with_nan = batch._replace(forces=forces)
    for kind in ("mse", "mae", "huber"):
        weights = petfunc.LossWeights.make(type=kind)
        loss, metrics = petfunc.make_loss(model, weights)(params, with_nan)
        assert torch.isfinite(loss)
        assert metrics["forces_count"].item() == forces[3:].numel()
        grads, _ = petfunc.make_grad_step(model, weights)(params, with_nan)
        assert all(torch.isfinite(g).all() for g in petfunc.tree.flatten(grads).values())
    # mse over the valid entries only, by hand
    _, f, _ = petfunc.energy_forces_strain_derivative(model.raw_energy)(
        params, batch.positions, batch.cell, batch.neighbors
    )
    _, metrics = petfunc.make_loss(model)(params, with_nan)
    expected = (f[3:] - forces[3:]).pow(2).mean()
    assert math.isclose(metrics["forces_loss"].item(), expected.item(), rel_tol=1e-12)


def test_loss_types_equal_torch_losses(dataset, fitted):
    """mse, mae and huber (any delta), with reduction mean or sum, equal torch.nn's
    losses on the labelled entries, which metatrain uses."""
    params = _params(fitted)
    model = petfunc.PET(CONFIG)
    batch = _batch(dataset, fitted, [0, 1, 2])
    _, f, _ = petfunc.energy_forces_strain_derivative(model.raw_energy)(
        params, batch.positions, batch.cell, batch.neighbors
    )
    forces = batch.forces.clone()
    forces[:2] = float("nan")  # metatrain drops NaN labels, then applies the torch loss
    batch = batch._replace(forces=forces)
    for reduction in ("mean", "sum"):
        cases = [
            ("mse", 1.0, torch.nn.MSELoss(reduction=reduction)),
            ("mae", 1.0, torch.nn.L1Loss(reduction=reduction)),
        ]
        cases += [("huber", d, torch.nn.HuberLoss(delta=d, reduction=reduction)) for d in (0.01, 0.1, 1.0)]
        for kind, delta, reference in cases:
            term = petfunc.LossTerm(1.0, kind, delta, reduction)
            weights = petfunc.LossWeights(petfunc.LossTerm(0.0), term, petfunc.LossTerm(0.0))
            loss, metrics = petfunc.make_loss(model, weights)(params, batch)
            expected = reference(f[2:], forces[2:]).item()
            assert math.isclose(metrics["forces_loss"].item(), expected, rel_tol=1e-12), (
                kind,
                delta,
                reduction,
            )
            assert math.isclose(loss.item(), expected, rel_tol=1e-12)
    with pytest.raises(ValueError, match="reduction"):
        petfunc.LossTerm(1.0, "mse", 1.0, "none")


def test_energy_only_loss_does_not_differentiate_positions(dataset, fitted):
    params = _params(fitted)
    batch = _batch(dataset, fitted, [0, 1])
    weights = petfunc.LossWeights.make(forces=0.0, stress=0.0)
    loss, metrics = petfunc.make_loss(petfunc.PET(CONFIG), weights)(params, batch)
    assert "forces_loss" not in metrics and "stress_loss" not in metrics
    raw = petfunc.PET(CONFIG).raw_energy(params, batch.positions, batch.cell, batch.neighbors)
    n = torch.tensor([4.0, 8.0], dtype=torch.float64)
    assert math.isclose(loss.item(), ((raw - batch.energy) / n).pow(2).mean().item(), rel_tol=1e-12)


def test_schedule_and_clipping_match_torch():
    # metatrain: LambdaLR with warm-up then cosine; lr(0) = 0
    schedule = petfunc.warmup_cosine(1e-3, 200, 0.1)
    assert schedule(0).item() == 0.0
    assert math.isclose(schedule(10).item(), 1e-3 * 10 / 20)
    assert math.isclose(schedule(20).item(), 1e-3)
    assert math.isclose(schedule(110).item(), 1e-3 * 0.5 * (1 + math.cos(math.pi * 90 / 180)))
    # clip_by_global_norm == torch.nn.utils.clip_grad_norm_
    g = {"a": torch.randn(5, 3, dtype=torch.float64), "b": torch.randn(7, dtype=torch.float64)}
    tensors = [g["a"].clone(), g["b"].clone()]
    for t in tensors:
        t.grad = t.clone()
    torch.nn.utils.clip_grad_norm_(tensors, 0.5)
    clipped, norm = petfunc.train.clip_by_global_norm(g, 0.5)
    assert torch.allclose(clipped["a"], tensors[0].grad, rtol=1e-14)
    assert torch.allclose(clipped["b"], tensors[1].grad, rtol=1e-14)


def test_adam_step_matches_torch_optim():
    # one functional step against torch.optim.Adam with the same lr and clipping
    params = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
    optimizer = petfunc.make_optimizer(0.01)
    state = petfunc.TrainState(params, optimizer.init(params))
    reference = [torch.nn.Parameter(params["w"].clone()), torch.nn.Parameter(params["b"].clone())]
    torch_opt = torch.optim.Adam(reference, lr=0.01)
    for _ in range(3):
        grads = {"w": torch.randn(4, 3, dtype=torch.float64), "b": torch.randn(3, dtype=torch.float64)}
        state, _ = petfunc.apply_gradients(optimizer, state, grads, grad_clip_norm=1.0)
        reference[0].grad, reference[1].grad = grads["w"].clone(), grads["b"].clone()
        torch.nn.utils.clip_grad_norm_(reference, 1.0)
        torch_opt.step()
    assert torch.allclose(state.params["w"], reference[0].detach(), rtol=1e-12, atol=1e-14)
    assert torch.allclose(state.params["b"], reference[1].detach(), rtol=1e-12, atol=1e-14)


@pytest.mark.slow
def test_inductor_compiled_step_equals_eager(dataset, fitted):
    params = _params(fitted)
    optimizer = petfunc.make_optimizer(1e-3)
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights())
    compiled = petfunc.compile(step, state, _batch(dataset, fitted, [0, 1]), backend="inductor")
    for index in SHAPES:
        batch = _batch(dataset, fitted, index)
        eager_state, _ = step(state, batch)
        new_state, _ = compiled(state, batch)
        a = petfunc.tree.flatten(eager_state.params)
        b = petfunc.tree.flatten(new_state.params)
        before = petfunc.tree.flatten(state.params)
        for key in a:
            if (a[key] - before[key]).abs().max() > 0:
                assert _relative(b[key] - before[key], a[key] - before[key]) < 1e-9, key
    assert compiled.num_graphs == 1
    # donated, as petfunc train runs it: inductor writes the update into the state
    _check_donated_step(step, state, dataset, fitted, "inductor")


@pytest.mark.parametrize("weight_decay", [None, 0.01])
def test_adamw_matches_torch_with_mixed_order_and_dtypes(weight_decay):
    # Adam and AdamW equal torch.optim with one dtype and with mixed dtypes, and the
    # gradient tree may list its keys in another order than the parameters
    for dtypes in [(torch.float64, torch.float64), (torch.float64, torch.float32)]:
        params = {"w": torch.randn(4, 3, dtype=dtypes[0]), "b": {"c": torch.randn(3, dtype=dtypes[1])}}
        optimizer = petfunc.make_optimizer(0.01, weight_decay=weight_decay)
        state = petfunc.TrainState(params, optimizer.init(params))
        reference = [torch.nn.Parameter(params["w"].clone()), torch.nn.Parameter(params["b"]["c"].clone())]
        kind = torch.optim.Adam if weight_decay is None else torch.optim.AdamW
        torch_opt = kind(
            reference, lr=0.01, **({} if weight_decay is None else {"weight_decay": weight_decay})
        )
        for _ in range(3):
            grads = {"b": {"c": torch.randn(3, dtype=dtypes[1])}, "w": torch.randn(4, 3, dtype=dtypes[0])}
            state, _ = petfunc.apply_gradients(optimizer, state, grads, grad_clip_norm=None)
            reference[0].grad, reference[1].grad = grads["w"].clone(), grads["b"]["c"].clone()
            torch_opt.step()
        rtol = 1e-12 if dtypes[1] == torch.float64 else 1e-5
        assert torch.allclose(state.params["w"], reference[0].detach(), rtol=rtol, atol=1e-7)
        assert torch.allclose(state.params["b"]["c"], reference[1].detach(), rtol=rtol, atol=1e-7)
        assert state.opt_state.mu["b"]["c"].shape == (3,) and state.opt_state.nu["w"].shape == (4, 3)
