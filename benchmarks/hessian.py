"""The Hessian of a periodic cell: vmap (full), chunks, and finite differences of forces.

Variants (float64):

* ``full``: ``petfunc.hessian.hessian`` (all 3N rows in one vmap), compiled;
* ``chunks``: the compiled row function over chunks of ``--chunk`` rows;
* ``full eager`` / ``forward eager``: reverse-over-reverse and forward-over-reverse
  without compilation;
* ``finite differences``: differences of the compiled force function, for several
  step sizes: central (2 points, 6N force calls, error O(h^2)) and fourth order
  (4 points, 12N force calls, error O(h^4)).

Accuracy is the max relative difference to the compiled full Hessian (the analytic
modes agree with each other to round-off; finite differences have truncation and
round-off errors). Target: the analytic Hessian at least 5x faster than finite
differences at equal accuracy (finite differences never reach the analytic
accuracy; the ratio is quoted against the most accurate scheme and step).

    python benchmarks/hessian.py                 # 64-atom diamond cell, d_pet=64, inductor
    python benchmarks/hessian.py --skip full,eager,forward   # when 3N rows at once do not fit
    python benchmarks/hessian.py --quick         # 8 atoms, tiny model, aot_eager
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ase.build
from _measure import measure, timed

import petfunc
from petfunc.hessian import chunked_hessian, hessian, hessian_rows


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="8 atoms, tiny model, aot_eager, 2 repeats")
    parser.add_argument("--repeat", type=int, default=2, help="supercell repeat of the 8-atom diamond cell")
    parser.add_argument("--d-pet", type=int, default=64)
    parser.add_argument(
        "--chunk", type=int, default=2, help="rows per chunk (on CPU, small chunks run fastest)"
    )
    parser.add_argument("--steps", default="1e-4", help="central-difference steps (A)")
    parser.add_argument("--steps4", default="1e-3,1e-4", help="fourth-order difference steps (A)")
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; quick: aot_eager)"
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--skip",
        default="",
        help="comma-separated variants to skip: full,chunks,eager,forward "
        "(skip 'full' when all 3N rows at once do not fit in memory)",
    )
    args = parser.parse_args()
    if args.quick:
        args.repeat, args.d_pet, args.chunk, args.repeats = 1, 8, 8, 2
        args.backend = args.backend or "aot_eager"
    args.backend = args.backend or "inductor"
    return args


def main():
    args = arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    f64 = torch.float64
    w = args.d_pet
    config = petfunc.PETConfig(
        atomic_types=(6,),
        cutoff=4.5,
        d_pet=w,
        d_head=w,
        d_node=2 * w,
        d_feedforward=2 * w,
        num_heads=max(1, min(8, w // 8)),
    )
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=f64)
    atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat((args.repeat,) * 3)
    atoms.rattle(0.05, seed=0)
    x, cell, nbrs = petfunc.from_atoms(atoms, config, dtype=f64)
    n = x.shape[0]
    skip = set(filter(None, args.skip.split(",")))
    print(
        f"{n}-atom periodic cell, {nbrs.centers.shape[0]} edges, PET d_pet={w} "
        f"({petfunc.tree.count(params)} parameters), float64, backend {args.backend}, "
        f"{torch.get_num_threads()} threads"
    )

    rows = []  # (variant, compile s, median s, peak MiB, relative error)
    reference = None  # the first analytic Hessian; the others are compared with it

    def error(h):
        return float((h - reference).abs().max() / reference.abs().max())

    if "full" not in skip:
        full = petfunc.compile(hessian(model.energy), params, x, cell, nbrs, backend=args.backend)
        t_compile, reference = timed(lambda: full(params, x, cell, nbrs))
        t, mem, _ = measure(lambda: full(params, x, cell, nbrs), args.repeats)
        rows.append(("full (vmap)", t_compile, t, mem, 0.0))
    if "chunks" not in skip:
        directions = torch.zeros(args.chunk, n, 3, dtype=f64)
        rows_fn = petfunc.compile(
            hessian_rows(model.energy), params, x, cell, nbrs, directions, backend=args.backend
        )
        t_compile, _ = timed(lambda: rows_fn(params, x, cell, nbrs, directions))
        chunked = chunked_hessian(rows_fn, args.chunk)
        t, mem, h = measure(lambda: chunked(params, x, cell, nbrs), args.repeats)
        if reference is None:
            reference = h
        rows.append((f"chunks of {args.chunk}", t_compile, t, mem, error(h)))
    if reference is None:
        raise SystemExit("skip at most one of 'full' and 'chunks': one is the reference")
    if "eager" not in skip:
        t, mem, h = measure(lambda: hessian(model.energy)(params, x, cell, nbrs), args.repeats)
        rows.append(("full eager", float("nan"), t, mem, error(h)))
    if "forward" not in skip:
        t, mem, h = measure(
            lambda: hessian(model.energy, mode="forward")(params, x, cell, nbrs), args.repeats
        )
        rows.append(("forward eager", float("nan"), t, mem, error(h)))

    forces = petfunc.compile(petfunc.forces(model.energy), params, x, cell, nbrs, backend=args.backend)
    t_compile, _ = timed(lambda: forces(params, x, cell, nbrs))

    def finite_differences(step, points):
        columns = []
        for k in range(3 * n):
            d = torch.zeros(3 * n, dtype=f64)
            d[k] = step
            d = d.reshape(n, 3)
            plus, minus = forces(params, x + d, cell, nbrs), forces(params, x - d, cell, nbrs)
            if points == 2:
                columns.append(-(plus - minus) / (2 * step))
            else:  # (8 [F(x+h) - F(x-h)] - [F(x+2h) - F(x-2h)]) / 12h
                plus2, minus2 = forces(params, x + 2 * d, cell, nbrs), forces(params, x - 2 * d, cell, nbrs)
                columns.append(-(8 * (plus - minus) - (plus2 - minus2)) / (12 * step))
        return torch.stack(columns).reshape(n, 3, n, 3)

    fd_rows = []
    schemes = [(2, s) for s in args.steps.split(",") if s] + [(4, s) for s in args.steps4.split(",") if s]
    for points, step in schemes:
        step = float(step)
        t, mem, h = measure(lambda: finite_differences(step, points), 1, warmup=0)
        fd_rows.append((f"fin. diff. {points}pt h={step:g}", t_compile, t, mem, error(h)))
    rows += fd_rows

    best_fd = min(fd_rows, key=lambda r: r[4])
    t_full = rows[0][2]  # the first analytic variant (full, or chunks when full is skipped)
    print(
        f"\n{'variant':<22} {'compile s':>9} {'median s':>9} {'peak +MiB':>9} {'rel. error':>10} {'vs best FD':>10}"
    )
    for variant, t_compile, t, mem, err in rows:
        compile_s = f"{t_compile:9.1f}" if t_compile == t_compile else " " * 9
        print(f"{variant:<22} {compile_s} {t:9.3f} {mem:9.1f} {err:10.1e} {best_fd[2] / t:9.1f}x")
    print(
        f"\nanalytic ({rows[0][0]}, compiled) is {best_fd[2] / t_full:.1f}x faster than the most accurate "
        f"finite differences ({best_fd[0]}, error {best_fd[4]:.1e}); one graph each"
    )


if __name__ == "__main__":
    main()
