"""The pure training step: eager torch.func gradients against metatrain's, the
compiled step against eager with one graph for every batch shape (donated too), a
falling loss, and the optimizer states it refuses."""

import dataclasses
import math

import ase
import numpy as np
import pytest
import torch

import petfunc
from petfunc.data import make_batch, sample_from_atoms
from tests.helpers.training import (
    CONFIG,
    SHAPES,
    batch_of,
    check_compiled_train_step,
    check_donated_step,
    check_gradients_against_metatrain,
    emt_samples,
    fitted_params,
    relative,
    warmed_up_compiled_step,
)


# -----------------------------------------------------------------------------------
# eager torch.func gradients == metatrain's training-mode gradients


def test_parameter_gradients_match_metatrain(dataset, fitted):
    check_gradients_against_metatrain(dataset, fitted, torch.device("cpu"))


# -----------------------------------------------------------------------------------
# compiled == eager, one graph for every batch shape


@pytest.fixture(scope="module")
def compiled_setup(dataset, fitted):
    return warmed_up_compiled_step(dataset, fitted, backend="aot_eager")


def test_compiled_step_equals_eager_on_every_shape(dataset, fitted, compiled_setup):
    check_compiled_train_step(*compiled_setup, dataset, fitted)


def test_donated_compiled_step_trains_like_eager(dataset, fitted, compiled_setup):
    """The compiled step with its state donated (as ``petfunc train`` runs it):
    trained step after step over batches of every shape, it follows the eager step,
    and the new state lives in the buffers of the one it was given."""
    step, _, state = compiled_setup
    check_donated_step(step, state, dataset, fitted, "aot_eager")


def test_compiled_energy_forces_stress_and_gradients_equal_eager(dataset, fitted):
    params = fitted_params(fitted, seed=5)
    model = petfunc.PET(CONFIG)
    grad_step = petfunc.make_grad_step(model, petfunc.LossWeights())
    efs = petfunc.energy_forces_stress(model.energy)

    def fn(params, batch):
        grads, metrics = grad_step(params, batch)
        return grads, metrics, efs(params, batch.positions, batch.cell, batch.neighbors)

    compiled = petfunc.compile(fn, params, batch_of(dataset, fitted, [0, 1]), backend="aot_eager")
    for index in ([2, 3, 4], [5], [6, 7, 8, 9]):
        batch = batch_of(dataset, fitted, index)
        expected = fn(params, batch)
        got = compiled(params, batch)
        for a, b in zip(petfunc.tree.tree_leaves(got), petfunc.tree.tree_leaves(expected)):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            assert relative(a[finite], b[finite]) < 1e-9
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
        for a, b in zip(petfunc.tree.tree_leaves(got), petfunc.tree.tree_leaves(expected)):
            finite = torch.isfinite(b)
            assert torch.equal(finite, torch.isfinite(a))
            assert relative(a[finite], b[finite]) < 1e-9
    assert compiled.num_graphs == 1


@pytest.mark.slow  # eager conditioning is checked against metatrain in the default run
def test_compiled_conditioned_model_equals_eager(dataset, fitted):
    """Charge/spin conditioning in the compiled graph: gradients, energies, forces
    and stress equal eager for batches of other sizes and charges; one graph."""

    config = dataclasses.replace(CONFIG, system_conditioning=True, max_charge=2, max_spin_multiplicity=3)
    samples = emt_samples(8, 3, config)
    for k, sample in enumerate(samples):
        sample.structure.charge, sample.structure.spin_multiplicity = k % 5 - 2, 1 + k % 3
    params = fitted_params(fitted, seed=2, config=config)
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


@pytest.mark.slow  # the default run compiles the long-range calculator (tests/ase/)
def test_compiled_long_range_model_equals_eager(fitted):
    """Long-range features in the compiled training step (Ewald, as metatrain trains):
    gradients, energies, forces and stress equal eager on batches whose k-grids,
    atoms and edges differ (the one-structure batch is padded with a molecule, so
    the direct sum runs too); one graph."""

    config = dataclasses.replace(
        CONFIG, long_range=petfunc.config.LongRangeConfig(enable=True, kspace_resolution=1.0)
    )
    samples = emt_samples(8, 4, config)
    w, c = fitted
    shapes = {
        tuple(make_batch([samples[i] for i in index], config, w, c).neighbors.long_range.kgrid.shape)
        for index in ([0, 1], [2, 3, 4], [5], [6, 7, 0, 1])
    }
    assert len(shapes) >= 3
    _check_compiled_equals_eager(config, samples, fitted_params(fitted, seed=2, config=config), fitted)


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
    params = fitted_params(fitted, config=config)
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
            assert relative(petfunc.tree.flatten(got[0])[key], value) < 1e-9, key
    assert compiled.num_graphs == 1


@pytest.mark.slow
def test_inductor_compiled_step_equals_eager(dataset, fitted):
    params = fitted_params(fitted)
    optimizer = petfunc.make_optimizer(1e-3)
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights(), grad_clip_norm=1.0)
    compiled = petfunc.compile(step, state, batch_of(dataset, fitted, [0, 1]), backend="inductor")
    for index in SHAPES:
        batch = batch_of(dataset, fitted, index)
        eager_state, _ = step(state, batch)
        new_state, _ = compiled(state, batch)
        a = petfunc.tree.flatten(eager_state.params)
        b = petfunc.tree.flatten(new_state.params)
        before = petfunc.tree.flatten(state.params)
        for key in a:
            if (a[key] - before[key]).abs().max() > 0:
                assert relative(b[key] - before[key], a[key] - before[key]) < 1e-9, key
    assert compiled.num_graphs == 1
    # donated, as petfunc train runs it: inductor writes the update into the state
    check_donated_step(step, state, dataset, fitted, "inductor")


# -----------------------------------------------------------------------------------
# training


def test_loss_falls(dataset, fitted):
    params = fitted_params(fitted, seed=1)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-2, 60, 0.05))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights(), grad_clip_norm=1.0)
    losses = []
    for epoch in range(30):
        total = 0.0
        for index in dataset.batch_indices(6, shuffle=True, seed=epoch):
            state, metrics = step(state, batch_of(dataset, fitted, index))
            total += metrics["loss"].item()
        losses.append(total)
    assert losses[-1] < 0.5 * losses[0], losses
    # a state made for other trained parameters is refused with the reason
    heads = petfunc.make_train_step(
        petfunc.PET(CONFIG), optimizer, petfunc.LossWeights(), train=petfunc.train.HEADS
    )
    with pytest.raises(ValueError, match=r"optimizer state does not fit the trained parameters"):
        heads(state, batch_of(dataset, fitted, [0]))
    # a torchopt optimizer's state made for the whole tree (the fitted composition and
    # scale included) is refused with the reason, not left to torchopt's "The size of
    # tensor a (2) must match"
    import torchopt

    adamw = torchopt.adamw(1e-3)
    plain = petfunc.make_train_step(petfunc.PET(CONFIG), adamw, petfunc.LossWeights())
    with pytest.raises(
        ValueError, match=r"made for every parameter, composition_weights and energy_scale included"
    ):
        plain(petfunc.TrainState(params, adamw.init(params)), batch_of(dataset, fitted, [0]))
    _, metrics = plain(
        petfunc.TrainState(params, adamw.init(petfunc.train.trainable(params))),
        batch_of(dataset, fitted, [0]),
    )
    assert math.isfinite(float(metrics["loss"]))


def test_compile_refuses_a_state_of_every_parameter_before_tracing(dataset, fitted, caplog):
    """``optimizer.init(params)`` includes the fitted composition and scale: petfunc.compile
    says so before it traces the step, so torch logs no failed operation first."""
    import logging

    import torchopt

    from petfunc.compile.logs import TRACING_LOGGERS

    params = fitted_params(fitted)
    adamw = torchopt.adamw(1e-3)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), adamw, petfunc.LossWeights())
    loggers = [logging.getLogger(name) for name in TRACING_LOGGERS]
    for logger in loggers:  # they do not propagate to the root logger, where caplog listens
        logger.addHandler(caplog.handler)
    try:
        with pytest.raises(
            ValueError, match=r"petfunc.compile: the optimizer state was made for every parameter.*init_state"
        ):
            petfunc.compile(
                step,
                petfunc.TrainState(params, adamw.init(params)),
                batch_of(dataset, fitted, [0]),
                backend="aot_eager",
            )
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
    # the check passes a state of the trained parameters, and one of a tree without the
    # fitted composition and scale (a custom energy's), made with optimizer.init
    from petfunc.train.step import refuse_state_of_every_parameter

    refuse_state_of_every_parameter((petfunc.init_state(params, adamw),))
    custom = {"weight": params["edge_embedder"]["weight"]}
    refuse_state_of_every_parameter((petfunc.TrainState(custom, adamw.init(custom)),))


# -----------------------------------------------------------------------------------
# a loss of one's own, any GradientTransformation, clipping only where asked


def hand_gradient(loss_fn, params, batch, train_paths):
    """``{path: gradient}`` of ``loss_fn`` by autograd on the whole tree."""
    leaves, spec = petfunc.tree.tree_flatten(params)
    variables = [leaf.detach().requires_grad_(True) for leaf in leaves]
    loss = loss_fn(petfunc.tree.tree_unflatten(variables, spec), batch)[0]
    grads = dict(zip(petfunc.tree.flatten(params), torch.autograd.grad(loss, variables)))
    return {path: grads[path] for path in train_paths}


def test_train_step_of_any_loss_with_a_hand_written_sgd_is_unclipped():
    """``make_train_step(optimizer=..., loss_fn=...)`` with an optimizer whose update
    takes neither ``params`` nor ``inplace``: one step is ``p - lr * grad`` of the
    trained leaves, unclipped though the gradient norm is above 1; clipping happens
    only with ``grad_clip_norm``."""
    from tests.helpers.toolkit import SGD, energy_loss, toy_batch, toy_params

    params, batch = toy_params(), toy_batch()
    sgd = SGD(0.01)
    train = lambda path, leaf: path.startswith(("mlp", "readout"))  # noqa: E731
    step = petfunc.make_train_step(optimizer=sgd, loss_fn=energy_loss, train=train)
    new, metrics = step(petfunc.init_state(params, sgd, train), batch)
    grads = hand_gradient(energy_loss, params, batch, petfunc.partition(params, train)[0])
    norm = torch.linalg.vector_norm(torch.cat([g.reshape(-1) for g in grads.values()]))
    assert norm > 1.0 and "grad_norm" not in metrics and set(metrics) == {"loss", "mean_energy"}
    before, after = petfunc.tree.flatten(params), petfunc.tree.flatten(new.params)
    for path in before:
        if path in grads:
            assert torch.allclose(after[path], before[path] - 0.01 * grads[path], rtol=1e-12, atol=1e-15), (
                path
            )
        else:
            assert torch.equal(after[path], before[path]), path
    assert int(new.opt_state["steps"]) == 1
    clipped = petfunc.make_train_step(optimizer=sgd, loss_fn=energy_loss, train=train, grad_clip_norm=1.0)
    new, metrics = clipped(petfunc.init_state(params, sgd, train), batch)
    assert torch.allclose(metrics["grad_norm"], norm, rtol=1e-12)
    after = petfunc.tree.flatten(new.params)
    for path, grad in grads.items():
        expected = before[path] - 0.01 * grad / (norm + 1e-6)
        assert torch.allclose(after[path], expected, rtol=1e-12, atol=1e-15), path


def test_compiled_train_step_of_any_loss_equals_eager():
    from tests.helpers.toolkit import energy_loss, toy_batch, toy_params

    optimizer = petfunc.adamw(1e-2, weight_decay=0.1)
    step = petfunc.make_train_step(optimizer=optimizer, loss_fn=energy_loss)
    state = petfunc.init_state(toy_params(), optimizer)
    compiled = petfunc.compile(step, state, toy_batch(3, seed=0), backend="aot_eager")
    for n, seed in ((3, 0), (4, 1)):
        batch = toy_batch(n, seed)
        (eager, eager_metrics), (got, metrics) = step(state, batch), compiled(state, batch)
        assert torch.allclose(metrics["loss"], eager_metrics["loss"], rtol=1e-12)
        for key, value in petfunc.tree.flatten(eager.params).items():
            assert torch.allclose(petfunc.tree.flatten(got.params)[key], value, rtol=1e-12, atol=1e-15), key
    assert compiled.num_graphs == 1


def test_train_step_takes_an_energy_or_a_loss():
    from tests.helpers.toolkit import SGD, energy_loss

    with pytest.raises(TypeError, match=r"an energy function \(with weights=\) or loss_fn=, not both"):
        petfunc.make_train_step(petfunc.PET(CONFIG), SGD(0.1), loss_fn=energy_loss)
    with pytest.raises(TypeError, match=r"weights= applies to petfunc's own loss"):
        petfunc.make_train_step(
            optimizer=SGD(0.1), loss_fn=energy_loss, weights=petfunc.LossWeights(forces=2.0)
        )
    with pytest.raises(TypeError, match=r"needs an optimizer"):
        petfunc.make_train_step(loss_fn=energy_loss)
    with pytest.raises(TypeError, match=r"must have init\(params\) and update"):
        petfunc.apply_gradients(
            object(), petfunc.TrainState({"w": torch.ones(2)}, None), {"w": torch.ones(2)}
        )


def test_update_gets_params_and_inplace_only_where_its_signature_takes_them():
    import torchopt

    from petfunc.train.step import update_options
    from tests.helpers.toolkit import SGD

    class Optax:
        def init(self, params):
            return ()

        def update(self, updates, state, params=None):
            return updates, state

    class AnyKeywords(Optax):
        def update(self, updates, state, **options):
            return updates, state

    params = {"w": torch.ones(2)}
    assert update_options(SGD(0.1), params=params, inplace=False) == {}
    assert update_options(Optax(), params=params, inplace=False) == {"params": params}
    assert update_options(torchopt.adam(0.1), params=params, inplace=False) == {
        "params": params,
        "inplace": False,
    }
    assert update_options(AnyKeywords(), params=params, inplace=False) == {"params": params, "inplace": False}
