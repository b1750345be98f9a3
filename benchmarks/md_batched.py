"""Batched MD (petfunc.dynamics.run) vs ASE's VelocityVerlet looping over the structures
with PETCalculator: the same trajectories, timed side by side, alternating A B A B.

    python benchmarks/md_batched.py --threads 2 [--structures 32] [--steps 50] [--compile]
"""

import argparse
import statistics
import time

import ase.build
import numpy as np
import torch
from ase import units
from ase.collections import g2
from ase.md.verlet import VelocityVerlet

import petfunc
from petfunc.ase import PETCalculator
from petfunc.dynamics import run


def structures(n, seed=0):
    """Rattled small molecules of H, C, N, O with 300 K momenta."""
    names = [name for name in g2.names if set(g2[name].numbers) <= {1, 6, 7, 8} and len(g2[name]) >= 3]
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        atoms = ase.build.molecule(names[rng.integers(len(names))])
        atoms.rattle(0.02, seed=i)
        masses = atoms.get_masses()[:, None]
        atoms.set_momenta(rng.standard_normal((len(atoms), 3)) * np.sqrt(masses * units.kB * 300))
        frames.append(atoms)
    return frames


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--structures", type=int, default=32)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--d-pet", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="compile both (inductor)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    petfunc.allocator.keep_freed_memory()
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), d_pet=args.d_pet, d_node=2 * args.d_pet)
    params = petfunc.PET(config).init(seed=0, dtype=torch.float32)
    frames = structures(args.structures)
    dt = 0.5 * units.fs
    print(f"# {len(frames)} molecules ({sum(len(a) for a in frames)} atoms), PET d_pet {args.d_pet}, float32, "
          f"{args.threads} threads, {args.steps} velocity Verlet steps of 0.5 fs, compile={args.compile}")
    calc = PETCalculator(config, params, compile=args.compile)

    def loop():
        out = []
        for atoms in frames:
            atoms = atoms.copy()
            atoms.calc = calc
            VelocityVerlet(atoms, dt).run(args.steps)
            out.append(atoms.positions.copy())
        return out

    def batched():
        result = run(config, params, frames, args.steps, dt, compile=args.compile)
        return [a.positions.copy() for a in result.atoms]

    variants = {"ASE VelocityVerlet, one structure at a time": loop, "petfunc.dynamics.run, batched": batched}
    outputs = {name: fn() for name, fn in variants.items()}  # first calls (compile with --compile)
    times = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    a, b = outputs.values()
    max_dx = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    base = statistics.median(times["ASE VelocityVerlet, one structure at a time"])
    print("| variant | median s | speed-up |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} | {base / statistics.median(t):.2f}x |")
    print(f"# largest final position difference {max_dx:.1e} Å (float32)")


if __name__ == "__main__":
    main()
