"""Vibrational frequencies of a molecule from the analytic PET Hessian.

    python examples/vibrations.py

1. Train a small PET (float64) on rattled water molecules labelled by ASE's EMT, with
   random rotations (PET is not rotation invariant by construction: it learns it).
2. Relax the molecule with the model (L-BFGS on the positions; the molecule may turn
   as a whole, so the check is on its interatomic distances).
3. Hessian d2E/dx2 by automatic differentiation, mass-weight it, diagonalise:
   frequencies in cm^-1. Six modes are translations (exactly 0) and rotations (tens
   of cm^-1: the learnt invariance is approximate, as EMT's finite-difference ones
   are not exactly 0 either).
4. Check against finite differences of the model's own forces, and print EMT's
   frequencies (ase.vibrations) for reference: they agree only as well as the
   quick fit does.

``PETFUNC_SMOKE=1`` runs a tiny version in seconds.
"""

import os
import tempfile
import time

import ase.build
import numpy as np
import torch
from ase import units
from ase.calculators.emt import EMT
from ase.optimize import BFGS
from ase.vibrations import Vibrations

import petfunc
from petfunc.hessian import hessian, mass_weighted


SMOKE = os.environ.get("PETFUNC_SMOKE") == "1"
N_STRUCTURES, EPOCHS, WIDTH, PEAK_LR = (8, 3, 8, 3e-3) if SMOKE else (32, 300, 16, 1e-2)  # about 30 s
F64 = torch.float64
torch.set_default_dtype(F64)

# %% EMT labels on rattled molecules, around EMT's own minimum
molecule = ase.build.molecule("H2O")
molecule.calc = EMT()
BFGS(molecule, logfile=None).run(fmax=1e-4)
frames = []
for i in range(N_STRUCTURES):
    atoms = molecule.copy()
    atoms.rattle(0.04, seed=i)
    atoms.calc = EMT()
    atoms.info["energy"], atoms.arrays["forces"] = atoms.get_potential_energy(), atoms.get_forces()
    frames.append(atoms)

config = petfunc.PETConfig(
    atomic_types=(1, 8),
    cutoff=4.0,
    d_pet=WIDTH,
    d_head=WIDTH,
    d_node=2 * WIDTH,
    d_feedforward=2 * WIDTH,
    num_heads=2,
)
dataset = petfunc.Dataset(
    [petfunc.data.sample_from_atoms(a, config, stress_key=None) for a in frames], config
)
composition, _ = dataset.fit_composition_and_scale()
model = petfunc.PET(config)
params = model.init(seed=0, dtype=F64)
params["composition_weights"] = torch.tensor(composition)
optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(PEAK_LR, EPOCHS * 4, warmup_fraction=0.05))
state = petfunc.init_state(params, optimizer)
train_step = petfunc.make_train_step(model, optimizer, petfunc.LossWeights.make(1.0, 100.0, 0.0))
for epoch in range(EPOCHS):
    for batch in dataset.batches(
        N_STRUCTURES // 4, composition, 1.0, dtype=F64, shuffle=True, seed=epoch, augment=True
    ):
        state, metrics = train_step(state, batch)
print(f"trained: force RMSE on the last batch {np.sqrt(float(metrics['forces_loss'])):.3f} eV/A")
params = state.params

# %% relax with the model
positions, cell, neighbors = petfunc.from_atoms(molecule, config)
energy_and_forces = petfunc.energy_and_forces(model.energy)
x = positions.clone().requires_grad_(True)
lbfgs = torch.optim.LBFGS([x], max_iter=200, tolerance_grad=1e-10, line_search_fn="strong_wolfe")


def closure():
    lbfgs.zero_grad()
    energy, forces = energy_and_forces(params, x.detach(), cell, neighbors)
    x.grad = -forces
    return energy.sum()


lbfgs.step(closure)
# the change of the interatomic distances (a turn of the whole molecule is no change)
moved = float((torch.cdist(x.detach(), x.detach()) - torch.cdist(positions, positions)).abs().max())
if moved < 0.3:
    positions = x.detach()
    residual = energy_and_forces(params, positions, cell, neighbors)[1].abs().max()
    print(f"relaxed with the model: max |F| = {float(residual):.1e} eV/A, distances changed <= {moved:.3f} A")
else:  # a poorly trained model (smoke mode) may have no minimum nearby
    print(
        f"the model's relaxation changed distances by {moved:.1f} A: keeping EMT's geometry (not a minimum)"
    )

# %% analytic Hessian -> frequencies
masses = torch.tensor(molecule.get_masses())


def frequencies(h):
    """cm^-1, imaginary modes as negative numbers (ASE's conversion)."""
    eigenvalues = torch.linalg.eigvalsh(mass_weighted(h, masses)).numpy()
    s = units._hbar * 1e10 / np.sqrt(units._e * units._amu)
    return np.sign(eigenvalues) * s * np.sqrt(np.abs(eigenvalues)) / units.invcm


start = time.perf_counter()
h = hessian(model.energy)(params, positions, cell, neighbors)
t_analytic = time.perf_counter() - start

# %% finite differences of the model's forces, for comparison
forces = petfunc.forces(model.energy)
n, step = positions.shape[0], 1e-4
start = time.perf_counter()
columns = []
for k in range(3 * n):
    d = torch.zeros(3 * n)
    d[k] = step
    d = d.reshape(n, 3)
    columns.append(
        -(forces(params, positions + d, cell, neighbors) - forces(params, positions - d, cell, neighbors))
        / (2 * step)
    )
h_fd = torch.stack(columns).reshape(n, 3, n, 3)
t_fd = time.perf_counter() - start

# %% EMT's own frequencies at EMT's minimum (finite differences by ase.vibrations)
with tempfile.TemporaryDirectory() as tmp:
    vib = Vibrations(molecule, name=os.path.join(tmp, "vib"))
    vib.run()
    emt = np.real(vib.get_frequencies()) - np.imag(vib.get_frequencies())

analytic, numeric = frequencies(h), frequencies(h_fd)
print(f"\n{'mode':>4} {'analytic':>10} {'finite diff':>12} {'EMT':>10}   (cm^-1)")
for i, (a, f, e) in enumerate(zip(analytic, numeric, np.sort(emt))):
    print(f"{i:4d} {a:10.2f} {f:12.2f} {e:10.2f}")
rel = float((h - h_fd).abs().max() / h.abs().max())
print(
    f"\nHessian: analytic {1000 * t_analytic:.0f} ms, finite differences ({6 * n} force calls) "
    f"{1000 * t_fd:.0f} ms; max relative difference {rel:.1e}"
)
print(
    f"vibrational modes: max |analytic - finite difference| = {np.abs(analytic[6:] - numeric[6:]).max():.3f} cm^-1"
)
