"""Batched MD (petfunc.dynamics.run) vs ASE's VelocityVerlet looping over the structures
with PETCalculator: the same trajectories, timed side by side, alternating A B A B.

    python benchmarks/md_batched.py --threads 2 [--structures 32] [--steps 50] [--compile]
"""

import sys
from pathlib import Path

import numpy as np
from ase import units
from ase.md.verlet import VelocityVerlet


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's petfunc, not an installed one
from petfunc.ase import PETCalculator
from petfunc.dynamics import run


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import batched_vs_loop, batched_vs_loop_parser, g2_molecules, interleaved


def structures(n, seed=0):
    """Rattled small molecules of H, C, N, O with 300 K momenta."""
    rng = np.random.default_rng(seed)
    frames = g2_molecules(n, rattle=0.02, seed=seed)
    for atoms in frames:
        masses = atoms.get_masses()[:, None]
        atoms.set_momenta(rng.standard_normal((len(atoms), 3)) * np.sqrt(masses * units.kB * 300))
    return frames


def main():
    args = batched_vs_loop_parser(__doc__.splitlines()[0], steps=50).parse_args()
    config, params = batched_vs_loop(args)
    frames = structures(args.structures)
    dt = 0.5 * units.fs
    print(
        f"# {len(frames)} molecules ({sum(len(a) for a in frames)} atoms), PET d_pet {args.d_pet}, float32, "
        f"{args.threads} threads, {args.steps} velocity Verlet steps of 0.5 fs, compile={args.compile}"
    )
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
    outputs, _ = interleaved(variants, args.repeats)
    a, b = outputs.values()
    max_dx = max(float(np.abs(x - y).max()) for x, y in zip(a, b))
    print(f"# largest final position difference {max_dx:.1e} Å (float32)")


if __name__ == "__main__":
    main()
