"""K ensemble members by vmap against a loop over K single models.

Variants, each for inference (energy, forces, stress) and for a training step
(energy + forces + stress loss, Adam):

* ``vmap``: one call of ``petfunc.ensemble`` (K members vmapped), compiled;
* ``loop``: K calls of the compiled single-model function (one graph, K parameter sets);
* ``eager vmap`` / ``eager loop``: the same without compilation.

All variants see the same batch (rattled diamond supercells, EMT labels) and start
from the same parameters; the script checks that vmap and loop agree. It prints
median times, per-member times, the loop/vmap ratio (target: >= 3 for K = 8) and
the rise of peak resident memory during the timed calls.

    python benchmarks/ensemble.py                     # K=8, d_pet=64, 4 x 64 atoms, inductor
    python benchmarks/ensemble.py --quick             # seconds of runtime, aot_eager
    python benchmarks/ensemble.py --d-pet 128 --threads 2 --repeats 20
    python benchmarks/ensemble.py --cutoff 2.0        # 4 neighbours per atom: per-call overhead matters

Run on a quiet machine: compile times and medians are sensitive to other load.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch
import torch.utils._pytree as pytree


sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import ase.build
from _measure import measure, timed
from ase.calculators.emt import EMT

import petfunc
import petfunc.ensemble as ensemble


def arguments():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, aot_eager, 3 repeats")
    parser.add_argument("--members", type=int, default=8)
    parser.add_argument("--structures", type=int, default=4, help="structures per batch")
    parser.add_argument("--repeat", type=int, default=2, help="supercell repeat of the 8-atom diamond cell")
    parser.add_argument("--d-pet", type=int, default=64)
    parser.add_argument(
        "--cutoff",
        type=float,
        default=4.5,
        help="PET cutoff (A); 2.0 leaves the 4 bonded neighbours: a sparse, molecule-like graph",
    )
    parser.add_argument(
        "--backend", default=None, help="torch.compile backend (default inductor; quick: aot_eager)"
    )
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--skip", default="", help="comma-separated variants to skip, e.g. 'eager'")
    args = parser.parse_args()
    if args.quick:
        args.members, args.structures, args.repeat, args.d_pet, args.repeats = (
            min(args.members, 4),
            2,
            1,
            8,
            3,
        )
        args.backend = args.backend or "aot_eager"
    args.backend = args.backend or "inductor"
    return args


def labelled_batch(config, n, repeat, dtype, seed=0):
    rng = np.random.default_rng(seed)
    frames = []
    for _ in range(n):
        atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat(repeat)
        atoms.set_cell(atoms.cell * rng.uniform(0.98, 1.02), scale_atoms=True)
        atoms.rattle(0.05, seed=int(rng.integers(1 << 20)))
        atoms.calc = EMT()
        atoms.info["energy"], atoms.arrays["forces"] = atoms.get_potential_energy(), atoms.get_forces()
        atoms.info["stress"] = atoms.get_stress()
        frames.append(atoms)
    samples = [petfunc.data.sample_from_atoms(a, config) for a in frames]
    return petfunc.make_batch(samples, config, [0.0], 1.0, dtype=dtype)


def max_relative(a, b):
    worst = 0.0
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        if x.is_floating_point():
            finite = torch.isfinite(y)
            worst = max(
                worst, float((x[finite] - y[finite]).abs().max() / y[finite].abs().max().clamp_min(1e-30))
            )
    return worst


def main():
    args = arguments()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    k = args.members
    w = args.d_pet
    config = petfunc.PETConfig(
        atomic_types=(6,),
        cutoff=args.cutoff,
        cutoff_width=min(0.5, args.cutoff / 4),
        d_pet=w,
        d_head=w,
        d_node=2 * w,
        d_feedforward=2 * w,
        num_heads=max(1, min(8, w // 8)),
    )
    model = petfunc.PET(config)
    params = ensemble.init(model, range(k), dtype=dtype)
    members = petfunc.tree.unstack(params)
    batch = labelled_batch(config, args.structures, (args.repeat,) * 3, dtype)
    data = (batch.positions, batch.cell, batch.neighbors)
    optimizer = petfunc.make_optimizer(1e-3)
    state = ensemble.init_state(params, optimizer)
    states = [ensemble.member_state(state, i) for i in range(k)]
    weights = petfunc.LossWeights.make(1.0, 10.0, 1.0)
    print(
        f"K={k} members, PET d_pet={w} ({petfunc.tree.count(members[0])} parameters each), "
        f"{batch.n_structures} structures, {batch.positions.shape[0]} atoms, "
        f"{batch.neighbors.centers.shape[0]} edges, {args.dtype}, backend {args.backend}, "
        f"{torch.get_num_threads()} threads"
    )

    single_efs = petfunc.energy_forces_stress(model.energy)
    ens_efs = ensemble.energy_forces_stress(model.energy)
    single_step = petfunc.make_train_step(model, optimizer, weights)
    ens_step = ensemble.make_train_step(model, optimizer, weights)
    stack = lambda outs: pytree.tree_map(lambda *xs: torch.stack(xs), *outs)  # noqa: E731

    rows = []
    skip = set(filter(None, args.skip.split(",")))
    for task in ("inference", "train step"):
        if task == "inference":
            vmap_fn, vmap_args = ens_efs, (params, *data)
            loop_fn, loop_args = single_efs, [(p, *data) for p in members]
        else:
            vmap_fn, vmap_args = ens_step, (state, batch)
            loop_fn, loop_args = single_step, [(s, batch) for s in states]
        results = {}
        if "eager" not in skip:
            t, mem, out = measure(lambda: vmap_fn(*vmap_args), args.repeats)
            rows.append((task, "eager vmap", float("nan"), t, mem))
            results["eager vmap"] = out
            t, mem, out = measure(lambda: [loop_fn(*a) for a in loop_args], args.repeats)
            rows.append((task, "eager loop", float("nan"), t, mem))
            results["eager loop"] = stack(out)
        compiled_vmap = petfunc.compile(vmap_fn, *vmap_args, backend=args.backend)
        t_compile, _ = timed(lambda: compiled_vmap(*vmap_args))
        t, mem, out = measure(lambda: compiled_vmap(*vmap_args), args.repeats)
        rows.append((task, "vmap", t_compile, t, mem))
        results["vmap"] = out
        compiled_loop = petfunc.compile(loop_fn, *loop_args[0], backend=args.backend)
        t_compile, _ = timed(lambda: compiled_loop(*loop_args[0]))
        t, mem, out = measure(lambda: [compiled_loop(*a) for a in loop_args], args.repeats)
        rows.append((task, "loop", t_compile, t, mem))
        results["loop"] = stack(out)
        graphs = (compiled_vmap.num_graphs, compiled_loop.num_graphs)
        print(
            f"{task}: vmap vs loop max relative difference {max_relative(results['vmap'], results['loop']):.1e}, "
            f"graphs compiled (vmap, loop) = {graphs}"
        )

    print(
        f"\n{'task':<11} {'variant':<11} {'compile s':>9} {'median ms':>10} {'ms/member':>10} {'loop/vmap':>9} {'peak +MiB':>9}"
    )
    medians = {(task, variant): t for task, variant, _, t, _ in rows}
    for task, variant, t_compile, t, mem in rows:
        partner = variant.replace("vmap", "loop") if "vmap" in variant else None
        ratio = f"{medians[(task, partner)] / t:9.2f}" if partner else " " * 9
        compile_s = f"{t_compile:9.1f}" if t_compile == t_compile else " " * 9
        print(
            f"{task:<11} {variant:<11} {compile_s} {1000 * t:10.2f} {1000 * t / k:10.2f} {ratio} {mem:9.1f}"
        )


if __name__ == "__main__":
    main()
