"""Relaxation and Langevin molecular dynamics of a periodic carbon cell with PET.

    python examples/md.py                          # random model, 64-atom diamond cell
    python examples/md.py model.pt --compile       # a petfunc parameter file, compiled
    python examples/md.py model.ckpt --steps 5000  # a metatrain checkpoint / model.pt
    PETFUNC_SMOKE=1 python examples/md.py          # a few steps (CI), also --smoke

1. Read the model: a petfunc parameter file or training checkpoint
   (``PETCalculator.from_checkpoint``) or a metatrain checkpoint / exported model
   (``PETCalculator.from_metatrain``). Without a path, a small PET with *random*
   parameters is used: the dynamics then runs and conserves what it should, but it
   is not the physics of carbon.
2. Relax positions and cell (FIRE on a ``FrechetCellFilter``, which uses the stress).
3. Run Langevin dynamics at ``--temperature``, writing every ``--interval``-th frame
   (positions, energy, forces, stress) to an extxyz trajectory, with a progress bar.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings
from pathlib import Path

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ase.build
import ase.io
from ase import units
from ase.constraints import FixCom
from ase.filters import FrechetCellFilter
from ase.md.langevin import Langevin
from ase.md.velocitydistribution import MaxwellBoltzmannDistribution, Stationary
from ase.optimize import FIRE
from tqdm import tqdm

import petfunc
from petfunc.ase import PETCalculator


def load_calculator(path, args, dtype):
    options = dict(compile=args.compile, backend=args.backend, dtype=dtype)
    if path is None:
        # random parameters; seed 1 of this small architecture has a stable
        # diamond-like minimum (other seeds may let atoms collapse onto each other)
        config = petfunc.PETConfig(
            atomic_types=(1, 6, 7, 8), d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2
        )
        params = petfunc.init(config, seed=1, dtype=torch.float64)
        print("model: RANDOM parameters (no checkpoint given): not a physical carbon model")
        return PETCalculator(config, params, **options)
    try:
        calc = PETCalculator.from_checkpoint(path, **options)
        print(f"model: petfunc parameters from {path}")
    except ValueError:
        calc = PETCalculator.from_metatrain(path, **options)
        print(f"model: metatrain model from {path}")
    return calc


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="petfunc params / metatrain checkpoint (default: random)")
    parser.add_argument("--structure", help="ASE-readable periodic structure (default: diamond)")
    parser.add_argument("--repeat", type=int, default=2, help="diamond cell repeats per axis")
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--relax-steps", type=int, default=200)
    parser.add_argument("--timestep", type=float, default=0.5, help="fs")
    parser.add_argument("--temperature", type=float, default=300.0, help="K")
    parser.add_argument("--friction", type=float, default=0.01, help="1/fs")
    parser.add_argument("--interval", type=int, default=10, help="trajectory stride")
    parser.add_argument("--output", default="md.extxyz")
    parser.add_argument("--compile", action="store_true", help="petfunc.compile (inductor)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float64")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (small cells: 1)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--smoke", action="store_true", help="a few steps on 8 atoms (CI)")
    args = parser.parse_args(argv)
    if args.smoke or os.environ.get("PETFUNC_SMOKE") == "1":
        args.smoke = True
        args.steps, args.relax_steps, args.interval, args.repeat = 20, 20, 5, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    petfunc.allocator.keep_freed_memory()  # every MD step reuses the last step's memory
    warnings.filterwarnings("ignore", category=DeprecationWarning)

    calc = load_calculator(args.model, args, getattr(torch, args.dtype))
    if args.structure:
        atoms = ase.io.read(args.structure)
    else:
        atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat(args.repeat)
        atoms.rattle(0.02, seed=args.seed)
    if not atoms.pbc.all():
        raise SystemExit("this example runs a periodic structure (it relaxes the cell)")
    atoms.calc = calc
    print(
        f"structure: {atoms.get_chemical_formula()} ({len(atoms)} atoms), "
        f"{'compiled (' + args.backend + ')' if args.compile else 'eager'}, {args.dtype}"
    )

    # -- relaxation of positions and cell ---------------------------------------------
    start = time.perf_counter()
    optimizer = FIRE(FrechetCellFilter(atoms), logfile=None)
    converged = optimizer.run(fmax=0.01, steps=args.relax_steps)
    fmax = np.abs(atoms.get_forces()).max()
    smax = np.abs(atoms.get_stress()).max() / units.GPa
    print(
        f"relaxation: {'converged' if converged else 'not converged'} after {optimizer.nsteps} "
        f"steps ({time.perf_counter() - start:.1f} s), E = {atoms.get_potential_energy():.4f} eV, "
        f"max |F| = {fmax:.2e} eV/A, max |stress| = {smax:.3f} GPa, V = {atoms.get_volume():.2f} A^3"
    )

    # -- Langevin dynamics --------------------------------------------------------------
    rng = np.random.default_rng(args.seed)
    MaxwellBoltzmannDistribution(atoms, temperature_K=args.temperature, rng=rng)
    Stationary(atoms)
    atoms.set_constraint(FixCom())  # Langevin noise would otherwise move the centre of mass
    dynamics = Langevin(
        atoms,
        args.timestep * units.fs,
        temperature_K=args.temperature,
        friction=args.friction / units.fs,
        fixcm=False,
        rng=rng,
    )
    output = Path(args.output)
    if output.exists():
        output.unlink()

    def write_frame():
        ase.io.write(output, atoms, format="extxyz", append=True)

    dynamics.attach(write_frame, interval=args.interval)
    bar = tqdm(total=args.steps, unit="step", desc="Langevin MD")

    def progress():
        if dynamics.nsteps == 0:  # observers also run once before the first step
            return
        bar.update(1)
        if dynamics.nsteps % args.interval == 0:
            bar.set_postfix(T=f"{atoms.get_temperature():.0f} K", E=f"{atoms.get_potential_energy():.3f} eV")

    dynamics.attach(progress, interval=1)
    start = time.perf_counter()
    dynamics.run(args.steps)
    bar.close()
    elapsed = time.perf_counter() - start
    frames = len(ase.io.read(output, index=":"))
    print(
        f"MD: {args.steps} steps of {args.timestep} fs in {elapsed:.1f} s "
        f"({1e3 * elapsed / max(args.steps, 1):.1f} ms/step), final T = {atoms.get_temperature():.0f} K; "
        f"{frames} frames written to {output}"
    )
    if args.compile:
        print(f"compilations: {calc.num_compilations}")


if __name__ == "__main__":
    main()
