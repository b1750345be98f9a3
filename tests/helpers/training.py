"""The EMT-labelled Cu/Al training setup shared by the training-step tests
(tests/train/, tests/gpu/, tests/ops/): the config, samples, batches, and the checks
of a training step (against metatrain, compiled against eager, donated).

The fixtures ``dataset`` and ``fitted`` (tests/conftest.py) are 12 of these samples
and their fitted composition weights and energy scale."""

import ase
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


def emt_samples(n, seed, config=CONFIG):
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


def emt_dataset():
    """The ``dataset`` fixture: 12 samples of :func:`emt_samples` (seed 0)."""
    return Dataset(emt_samples(12, 0), CONFIG)


def fitted_params(fitted, seed=0, dtype=torch.float64, device="cpu", config=CONFIG):
    """PET parameters of ``config`` (seed ``seed``) with the fitted composition and scale."""
    w, c = fitted
    params = petfunc.PET(config).init(seed=seed, dtype=dtype, device=device)
    params["composition_weights"] = torch.tensor(w, dtype=dtype, device=device)
    params["energy_scale"] = torch.tensor(c, dtype=dtype, device=device)
    return params


def batch_of(dataset, fitted, index, dtype=torch.float64, device="cpu"):
    """The training batch of the samples ``index`` of ``dataset``."""
    w, c = fitted
    return make_batch([dataset.samples[i] for i in index], CONFIG, w, c, dtype=dtype, device=device)


def relative(a, b):
    """max |a - b| / max |b|, computed on the CPU (``a`` and ``b`` may be on different devices)."""
    a, b = a.detach().cpu(), b.detach().cpu()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def check_gradients_against_metatrain(dataset, fitted, device):
    """petfunc's eager torch.func parameter gradients of the training loss (energy,
    forces, stress) on ``device`` equal metatrain's training-mode gradients computed
    there (1e-8 relative), and so do the losses (1e-12)."""
    pytest.importorskip("metatrain")
    from metatomic.torch import systems_to_torch
    from metatrain.utils.data.target_info import get_energy_target_info
    from metatrain.utils.evaluate_model import evaluate_model
    from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

    from tests.helpers import mtt_reference as ref

    # A batch of 3 structures (no padding needed), float64, energy + forces + stress.
    params = fitted_params(fitted, seed=3, device=device)
    batch = batch_of(dataset, fitted, [0, 1, 2], device=device)
    weights = petfunc.LossWeights.make(energy=1.0, forces=2.0, stress=0.5)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(CONFIG), weights)(params, batch)

    # The same weights and structures in metatrain, train mode, its evaluate_model.
    model = ref.make_model(CONFIG)
    ref.load_params(model, petfunc.tree.tree_map(lambda t: t.cpu(), params))
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
        err = relative(ours[key], reference)
        assert err < 1e-8, f"{key}: relative gradient error {err:.2e}"
        checked += 1
    assert checked == len(ours)


def warmed_up_compiled_step(dataset, fitted, device="cpu", **compile_options):
    """``(step, compiled step, state)``: the train step, its ``petfunc.compile`` (traced
    on batch [5, 6], ``compile_options`` passed on) and the state after two eager
    steps, so that the moments and the schedule are non-trivial."""
    params = fitted_params(fitted, device=device)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 100, 0.05))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(petfunc.PET(CONFIG), optimizer, petfunc.LossWeights(), grad_clip_norm=1.0)
    for index in ([0, 1], [2, 3, 4]):
        state, _ = step(state, batch_of(dataset, fitted, index, device=device))
    compiled = petfunc.compile(
        step, state, batch_of(dataset, fitted, [5, 6], device=device), **compile_options
    )
    return step, compiled, state


# (n structures), different numbers of atoms, edges and neighbours; [9] is one structure
SHAPES = [[0, 1, 2], [3, 4, 5, 6], [7, 8], [9], [10, 11, 0, 1, 2]]


def check_compiled_train_step(step, compiled, state, dataset, fitted, device="cpu"):
    """On every batch of SHAPES (each a different size), the compiled step's metrics,
    parameter updates and optimizer moments equal the eager step's (1e-9 relative),
    on ``device``, from one compiled graph."""
    seen = set()
    for index in SHAPES:
        batch = batch_of(dataset, fitted, index, device=device)
        seen.add((batch.n_structures, batch.positions.shape[0], batch.neighbors.nef_index.shape[1]))
        eager_state, eager_metrics = step(state, batch)
        new_state, metrics = compiled(state, batch)
        for key in eager_metrics:
            assert relative(metrics[key], eager_metrics[key]) < 1e-9, key
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
            err = relative(flat_compiled[key] - before[key], update)
            assert err < 1e-9, f"{key}: {err:.2e}"
        for a, b in zip(
            petfunc.tree.tree_leaves(new_state.opt_state),
            petfunc.tree.tree_leaves(eager_state.opt_state),
        ):
            assert relative(a.double(), b.double()) < 1e-9
    assert len(seen) == len(SHAPES)
    assert compiled.num_graphs == 1, f"{compiled.num_graphs} graphs compiled"


def check_donated_step(step, state, dataset, fitted, backend, device="cpu"):
    """The step compiled with its state donated follows the eager step over the batches
    of SHAPES, its new state in the buffers of the one it was given; one graph."""
    reference = petfunc.tree.tree_map(torch.clone, state)
    state = petfunc.pack_state(petfunc.tree.tree_map(torch.clone, state))
    example = batch_of(dataset, fitted, [5, 6], device=device)
    compiled = petfunc.compile(step, state, example, backend=backend, donate_argnums=(0,))

    def buffers(state):  # where the trained parameters and each moment live
        parts = [petfunc.train.trainable(state.params), state.opt_state.mu, state.opt_state.nu]
        return [petfunc.tree.packed_range(petfunc.tree.tree_leaves(p))[0].data_ptr() for p in parts]

    donated = buffers(state)
    for index in SHAPES:
        batch = batch_of(dataset, fitted, index, device=device)
        before = petfunc.tree.flatten(reference.params)
        reference, eager_metrics = step(reference, batch)
        state, metrics = compiled(state, batch)
        assert relative(metrics["loss"], eager_metrics["loss"]) < 1e-9
        flat_eager = petfunc.tree.flatten(reference.params)
        flat_compiled = petfunc.tree.flatten(state.params)
        for key in flat_eager:
            update = flat_eager[key] - before[key]
            if update.abs().max() > 0:
                assert relative(flat_compiled[key] - before[key], update) < 1e-8, key
        assert buffers(state) == donated
    assert compiled.num_graphs == 1
