"""Train PET on EMT copper with pure functions: params, optimizer state and a loop.

    python examples/train_functional.py [--compile]

``PETFUNC_SMOKE=1`` runs a tiny version in seconds. ``--compile`` traces the training
step once with ``petfunc.compile`` (a few minutes on a CPU) and reuses it for every
batch shape.
"""

import os
import sys

import ase.build
import numpy as np
import torch
from ase.calculators.emt import EMT

import petfunc


SMOKE = os.environ.get("PETFUNC_SMOKE") == "1"
N_STRUCTURES, EPOCHS, WIDTH = (8, 2, 8) if SMOKE else (120, 30, 64)

# %% EMT labels on rattled, strained copper cells (4 or 8 atoms: two batch shapes)
rng = np.random.default_rng(0)
frames = []
for i in range(N_STRUCTURES):
    atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1 + i % 2, 1, 1))
    atoms.set_cell(atoms.cell * rng.uniform(0.97, 1.03), scale_atoms=True)
    atoms.rattle(0.1, seed=i)
    atoms.calc = EMT()
    atoms.info["energy"], atoms.arrays["forces"] = atoms.get_potential_energy(), atoms.get_forces()
    atoms.info["stress"] = atoms.get_stress()
    frames.append(atoms)

config = petfunc.PETConfig(
    atomic_types=(29,),
    cutoff=4.0,
    d_pet=WIDTH,
    d_head=WIDTH,
    d_node=2 * WIDTH,
    d_feedforward=2 * WIDTH,
    num_heads=4,
)
dataset = petfunc.Dataset([petfunc.data.sample_from_atoms(a, config) for a in frames], config)
train, test = dataset[: int(0.8 * len(dataset))], dataset[int(0.8 * len(dataset)) :]
composition, scale = train.fit_composition_and_scale()

# %% parameters (a nested dict of tensors) and optimizer state: plain values
model = petfunc.PET(config)
params = model.init(seed=0)
params["composition_weights"] = torch.tensor(composition, dtype=torch.float32)
params["energy_scale"] = torch.tensor(scale, dtype=torch.float32)
steps = EPOCHS * len(train.batch_indices(4))
optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(3e-3, steps, warmup_fraction=0.05))
state = petfunc.init_state(params, optimizer)
train_step = petfunc.make_train_step(model, optimizer, petfunc.LossWeights.make(1.0, 10.0, 1.0))


def batches(data, epoch=0):
    return data.batches(4, composition, scale, shuffle=True, seed=epoch, augment=True)


if "--compile" in sys.argv:
    train_step = petfunc.compile(train_step, state, next(iter(batches(train))))

# %% the loop: state in, state out
for epoch in range(EPOCHS):
    for batch in batches(train, epoch):
        state, metrics = train_step(state, batch)
    if epoch % max(1, EPOCHS // 5) == 0 or epoch == EPOCHS - 1:
        print(f"epoch {epoch:3d}  loss {float(metrics['loss']):.4f}")

# %% test errors in eV and eV/A (the loss works in units of the energy scale)
loss_fn = petfunc.make_loss(model, petfunc.LossWeights.make(1.0, 1.0, 1.0))
sums = {}
for batch in test.batches(4, composition, scale):
    _, metrics = loss_fn(state.params, batch)
    for key in ("energy_sse", "energy_count", "forces_sse", "forces_count"):
        sums[key] = sums.get(key, 0.0) + float(metrics[key])
energy_rmse = scale * np.sqrt(sums["energy_sse"] / sums["energy_count"])
forces_rmse = scale * np.sqrt(sums["forces_sse"] / sums["forces_count"])
print(
    f"test RMSE: energy {1000 * energy_rmse:.1f} meV/atom, forces {forces_rmse:.3f} eV/A "
    f"(force std of the data {np.std(np.concatenate([a.arrays['forces'] for a in frames])):.3f} eV/A)"
)
