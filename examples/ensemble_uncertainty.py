"""A committee of PET models trained at once with vmap; its spread grows off the data.

    python examples/ensemble_uncertainty.py [--compile]

Four members learn EMT copper from cells with lattice constants 3.55-3.65 A. The
committee is then asked about compressed and stretched cells (3.2-4.1 A): its mean
follows EMT near the training data and its standard deviation, the uncertainty
estimate, grows away from it. Writes ``ensemble_uncertainty.png`` in the current
directory. ``PETFUNC_SMOKE=1`` runs a tiny version in seconds.
"""

import os
import sys

import ase.build
import matplotlib
import numpy as np
import torch
from ase.calculators.emt import EMT

import petfunc
import petfunc.ensemble as ensemble


matplotlib.use("Agg")
import matplotlib.pyplot as plt


SMOKE = os.environ.get("PETFUNC_SMOKE") == "1"
K, N_STRUCTURES, EPOCHS, WIDTH = (3, 8, 2, 8) if SMOKE else (4, 64, 40, 32)
TRAIN_RANGE = (3.55, 3.65)


def copper(a, rattle=0.0, seed=0):
    atoms = ase.build.bulk("Cu", "fcc", a=a, cubic=True)
    if rattle:
        atoms.rattle(rattle, seed=seed)
    atoms.calc = EMT()
    atoms.info["energy"], atoms.arrays["forces"] = atoms.get_potential_energy(), atoms.get_forces()
    atoms.info["stress"] = atoms.get_stress()
    return atoms


# %% training data and K members, stacked along a leading axis
rng = np.random.default_rng(0)
frames = [copper(rng.uniform(*TRAIN_RANGE), rattle=0.05, seed=i) for i in range(N_STRUCTURES)]
config = petfunc.PETConfig(
    atomic_types=(29,),
    cutoff=4.5,
    d_pet=WIDTH,
    d_head=WIDTH,
    d_node=2 * WIDTH,
    d_feedforward=2 * WIDTH,
    num_heads=4,
)
dataset = petfunc.Dataset([petfunc.data.sample_from_atoms(a, config) for a in frames], config)
composition, _ = dataset.fit_composition_and_scale()
scale = 1.0  # eV; the fitted scale (RMS per-atom residual) is a few meV on such narrow data
model = petfunc.PET(config)
params = ensemble.init(model, seeds=range(K))
params["composition_weights"] = torch.tensor(composition, dtype=torch.float32).expand(K, -1).clone()
params["energy_scale"] = torch.full((K,), scale, dtype=torch.float32)

steps = EPOCHS * len(dataset.batch_indices(8))
optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(3e-3, steps, warmup_fraction=0.05))
state = ensemble.init_state(params, optimizer)
train_step = ensemble.make_train_step(model, optimizer, petfunc.LossWeights.make(1.0, 10.0, 1.0))
if "--compile" in sys.argv:
    train_step = petfunc.compile(train_step, state, next(iter(dataset.batches(8, composition, scale))))

# %% all members take their step on the same batch, in one call
for epoch in range(EPOCHS):
    for batch in dataset.batches(8, composition, scale, shuffle=True, seed=epoch, augment=True):
        state, metrics = train_step(state, batch)
    if epoch % max(1, EPOCHS // 5) == 0 or epoch == EPOCHS - 1:
        print(f"epoch {epoch:3d}  loss per member " + " ".join(f"{x:.3f}" for x in metrics["loss"].tolist()))

# %% the committee away from the data
lattice = np.linspace(3.2, 4.1, 10 if SMOKE else 31)
probes = [copper(a) for a in lattice]
positions, cell, neighbors = petfunc.from_atoms(probes, config)
committee = ensemble.committee(model.energy)(state.params, positions, cell, neighbors)
n_atoms = len(probes[0])
reference = np.array([a.info["energy"] for a in probes]) / n_atoms
mean = committee.energy.detach().numpy() / n_atoms
std = committee.energy_std.detach().numpy() / n_atoms
force_std = committee.forces_std.detach().reshape(len(probes), n_atoms, 3).pow(2).mean((1, 2)).sqrt().numpy()

inside = (lattice >= TRAIN_RANGE[0]) & (lattice <= TRAIN_RANGE[1])
print(f"{'a (A)':>6} {'EMT':>8} {'mean':>8} {'std':>8}  (eV/atom)")
for a, e, m, s in zip(lattice, reference, mean, std):
    print(
        f"{a:6.2f} {e:8.4f} {m:8.4f} {s:8.4f}"
        + ("  <- training range" if TRAIN_RANGE[0] <= a <= TRAIN_RANGE[1] else "")
    )
print(
    f"std inside the training range {std[inside].mean() * 1000:.1f} meV/atom, "
    f"at 3.2 A {std[0] * 1000:.1f}, at 4.1 A {std[-1] * 1000:.1f} meV/atom"
)

fig, (top, bottom) = plt.subplots(2, 1, figsize=(6, 6), sharex=True)
for axis in (top, bottom):
    axis.axvspan(*TRAIN_RANGE, color="0.9", label="training data")
top.plot(lattice, reference, "k--", label="EMT")
top.plot(lattice, mean, "C0", label=f"committee mean (K={K})")
top.fill_between(lattice, mean - 2 * std, mean + 2 * std, color="C0", alpha=0.3, label="mean +- 2 std")
top.set_ylabel("energy (eV/atom)")
top.legend()
bottom.semilogy(lattice, std, "C0", label="energy std (eV/atom)")
bottom.semilogy(lattice, force_std, "C1", label="force std, RMS (eV/A)")
bottom.set_xlabel("lattice constant (A)")
bottom.set_ylabel("committee std")
bottom.legend()
fig.tight_layout()
fig.savefig("ensemble_uncertainty.png", dpi=120)
print("wrote ensemble_uncertainty.png")
