"""Data-parallel training speed: steps per second with 1, 2, ... processes.

Each process count is a fresh torchrun-like launch (one subprocess per rank,
``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set; gloo on CPU, NCCL on
CUDA) running :class:`petfunc.distributed.DataParallel` on carbon_reduced_100
(energy + forces + virial; generated EMT carbon cells when the file is missing).

* strong scaling (default): the *global* batch (``--batch``) is split over the
  ranks; ideal is N times the one-process steps/s. Efficiency = sps_N / (N sps_1).
* weak scaling (``--weak``): every rank has ``--batch`` structures; efficiency =
  sps_N / sps_1 (the global batch grows N times).

On CPU each rank uses ``--threads`` torch threads (default 1), so N processes need
N free cores; on a shared machine the numbers are noisy. On CUDA rank r uses
``cuda:r``. ``--compile`` compiles the gradient step (``--backend``, default
inductor; long on CPU).

    python benchmarks/ddp.py [--nprocs 1 2] [--steps 10] [--batch 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch


HERE = Path(__file__).resolve().parent
DATA = HERE.parent.parent / "shared" / "data" / "carbon_reduced_100.xyz"


def _frames():
    import ase.io

    if DATA.exists():
        return ase.io.read(DATA, ":")
    from _measure import emt_carbon_frames

    print(f"# {DATA} not found: generated EMT carbon cells", file=sys.stderr)
    return emt_carbon_frames(64, alternate_size=True)


def child(args):
    import petfunc
    from petfunc import distributed as pdist
    from petfunc.data import Dataset, sample_from_atoms
    from petfunc.train import LossWeights, init_state, make_optimizer, warmup_cosine

    torch.set_num_threads(args.threads)
    info = pdist.init_from_env(device=args.device)
    dtype = getattr(torch, args.dtype)
    config = petfunc.PETConfig.from_hypers(
        {
            "atomic_types": [6],
            "d_pet": args.d_pet,
            "d_node": 2 * args.d_pet,
            "d_head": args.d_pet,
            "d_feedforward": 2 * args.d_pet,
        }
    )
    samples = [
        sample_from_atoms(
            a, config, energy_key="energy", forces_key="force", stress_key=None, virial_key="virial"
        )
        for a in _frames()
    ]
    data = Dataset(samples, config)
    w, c = data.fit_composition_and_scale()
    params = petfunc.PET(config).init(seed=0, dtype=dtype, device=info.device)
    params["composition_weights"] = torch.tensor(w, dtype=torch.float64, device=info.device)
    params["energy_scale"] = torch.tensor(c, dtype=torch.float64, device=info.device)
    optimizer = make_optimizer(warmup_cosine(1e-4, 1000))
    state = init_state(params, optimizer)
    dp = pdist.DataParallel(
        petfunc.PET(config),
        optimizer,
        LossWeights(),
        1.0,
        compile=args.compile,
        backend=args.backend,
        info=info,
    )
    global_batch = args.batch * (info.world_size if args.weak else 1)
    n_steps = args.warmup + args.steps
    plan = []
    epoch = 0
    while len(plan) < n_steps:
        plan += pdist.shard_batches(
            data.batch_indices(global_batch, True, seed=epoch, drop_last=True), info.rank, info.world_size
        )
        epoch += 1
    # batches are built before timing (the trainer overlaps nothing either way)
    batches = [
        petfunc.data.make_batch([samples[i] for i in idx], config, w, c, dtype, info.device)
        for idx in plan[:n_steps]
    ]

    def sync():
        if info.device.type == "cuda":
            torch.cuda.synchronize()
        if info.distributed:
            torch.distributed.barrier()

    t_first = time.perf_counter()
    for b in batches[: args.warmup]:
        state, metrics = dp.step(state, b)
    sync()
    t0 = time.perf_counter()
    for b in batches[args.warmup :]:
        state, metrics = dp.step(state, b)
    float(metrics["loss"])
    sync()
    elapsed = time.perf_counter() - t0
    if info.is_main:
        print(
            json.dumps(
                {
                    "world_size": info.world_size,
                    "steps": args.steps,
                    "seconds": elapsed,
                    "steps_per_s": args.steps / elapsed,
                    "warmup_s": t0 - t_first,
                    "atoms_per_rank_step": float(np.mean([b.positions.shape[0] for b in batches])),
                    "device": str(info.device),
                    "graphs": dp.num_graphs if args.compile else None,
                }
            )
        )
    pdist.shutdown()


def launch(n, argv, timeout):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for rank in range(n):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(n),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, __file__, "--_child", *argv], env=env, stdout=subprocess.PIPE, text=True
            )
        )
    out = None
    try:
        for rank, p in enumerate(procs):
            stdout, _ = p.communicate(timeout=timeout)
            if p.returncode != 0:
                raise RuntimeError(f"{n} processes: rank {rank} exited with {p.returncode}")
            if rank == 0:
                out = json.loads(stdout.strip().splitlines()[-1])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--nprocs", type=int, nargs="+", default=None, help="default: 1 2 (CPU), 1..#GPUs (CUDA)"
    )
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--batch", type=int, default=8, help="global batch (per rank with --weak)")
    parser.add_argument("--weak", action="store_true")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--d-pet", type=int, default=32, help="d_pet (d_node, d_feedforward = 2 d_pet)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--timeout", type=float, default=1800)
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--_child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args._child:
        return child(args)
    if args.nprocs is None:
        args.nprocs = list(range(1, torch.cuda.device_count() + 1)) if args.device == "cuda" else [1, 2]
    child_argv = (
        [
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            "--batch",
            str(args.batch),
            "--device",
            args.device,
            "--dtype",
            args.dtype,
            "--d-pet",
            str(args.d_pet),
            "--threads",
            str(args.threads),
            "--backend",
            args.backend,
        ]
        + (["--weak"] if args.weak else [])
        + (["--compile"] if args.compile else [])
    )
    print(
        f"# data-parallel steps/s: {args.device}, {args.dtype}, d_pet {args.d_pet}, "
        f"{'weak' if args.weak else 'strong'} scaling, batch {args.batch}, {args.threads} thread(s)/rank, "
        f"{'compiled ' + args.backend if args.compile else 'eager'}"
    )
    rows = []
    for n in args.nprocs:
        r = launch(n, child_argv, args.timeout)
        rows.append(r)
    print(f"{'procs':>5} {'steps/s':>9} {'atoms/rank':>10} {'speed-up':>9} {'efficiency':>10}")
    for r in rows:
        n = r["world_size"]
        ratio = r["steps_per_s"] / rows[0]["steps_per_s"]
        speedup = ratio * n / rows[0]["world_size"] if args.weak else ratio
        eff = speedup / (n / rows[0]["world_size"])
        r.update(speedup=speedup, efficiency=eff)
        print(
            f"{n:>5} {r['steps_per_s']:>9.3f} {r['atoms_per_rank_step']:>10.1f} {speedup:>9.2f} {eff:>10.2f}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
