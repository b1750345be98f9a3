"""Batched FIRE (petfunc.relax.fire) vs ASE's FIRE looping over the structures with
PETCalculator: the same relaxations (same steps, same final positions to round-off),
timed side by side, alternating A B A B.

    python benchmarks/relax.py --threads 2 [--structures 32] [--compile]
    python benchmarks/relax.py --threads 2 --cells     # crystals, FrechetCellFilter

``--cells``: strained, rattled small crystals (fcc, bcc, diamond, rocksalt-like
mixtures of H, C, N, O) relaxed with their cells through ASE's FrechetCellFilter,
in both variants.
"""

import sys
from pathlib import Path

import ase.build
import numpy as np
from ase.filters import FrechetCellFilter
from ase.optimize import FIRE as AseFIRE


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's petfunc, not an installed one
from petfunc.ase import PETCalculator
from petfunc.relax import fire


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import batched_vs_loop, batched_vs_loop_parser, g2_molecules, interleaved


def crystals(n, seed=0):
    """Small strained crystals of C, N, O and H (2 to 16 atoms)."""
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        kind = ["fcc", "bcc", "diamond", "sc"][i % 4]
        a = {"fcc": 3.6, "bcc": 2.9, "diamond": 3.57, "sc": 2.5}[kind]
        atoms = ase.build.bulk("C", kind, a=a, cubic=bool(rng.integers(2)))
        if len(atoms) < 4:
            atoms = atoms * (2, 1, 1)
        numbers = atoms.numbers.copy()
        numbers[rng.random(len(numbers)) < 0.3] = rng.choice([1, 7, 8])
        atoms.numbers = numbers
        strain = np.eye(3) + rng.normal(0, 0.03, (3, 3))
        atoms.set_cell(atoms.cell[:] @ strain, scale_atoms=True)
        atoms.rattle(0.05, seed=i)
        frames.append(atoms)
    return frames


def main():
    parser = batched_vs_loop_parser(__doc__.splitlines()[0], steps=100)
    parser.add_argument("--fmax", type=float, default=0.05)
    parser.add_argument("--cells", action="store_true", help="crystals with FrechetCellFilter")
    args = parser.parse_args()
    config, params = batched_vs_loop(args)
    frames = crystals(args.structures) if args.cells else g2_molecules(args.structures, rattle=0.1)
    cell_filter = FrechetCellFilter if args.cells else None
    what = "crystals (FrechetCellFilter)" if args.cells else "molecules"
    print(
        f"# {len(frames)} {what} ({sum(len(a) for a in frames)} atoms), PET d_pet {args.d_pet}, float32, "
        f"{args.threads} threads, fmax {args.fmax}, at most {args.steps} steps, compile={args.compile}"
    )
    calc = PETCalculator(config, params, compile=args.compile)

    def loop():
        out = []
        for atoms in frames:
            atoms = atoms.copy()
            atoms.calc = calc
            optimizer = AseFIRE(atoms if cell_filter is None else cell_filter(atoms), logfile=None)
            optimizer.run(fmax=args.fmax, steps=args.steps)
            out.append((atoms.positions.copy(), optimizer.nsteps))
        return out

    def batched():
        result = fire(
            config,
            params,
            frames,
            fmax=args.fmax,
            steps=args.steps,
            compile=args.compile,
            cell_filter=cell_filter,
        )
        return [(a.positions.copy(), s) for a, s in zip(result.atoms, result.steps)]

    variants = {"ASE FIRE, one structure at a time": loop, "petfunc.relax.fire, batched": batched}
    outputs, _ = interleaved(variants, args.repeats)
    (a, b) = outputs.values()
    same_steps = sum(x[1] == y[1] for x, y in zip(a, b))
    max_dx = max(float(np.abs(x[0] - y[0]).max()) for x, y in zip(a, b))
    total = sum(s for _, s in a)
    print(
        f"# {total} FIRE steps in all; same step count for {same_steps}/{len(a)} structures; "
        f"largest position difference {max_dx:.1e} Å (float32)"
    )


if __name__ == "__main__":
    main()
