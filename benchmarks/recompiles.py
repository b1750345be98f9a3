"""Graphs compiled for batches of growing size: what the unguarded_sum_helper patch
saves.

For a float32 sum over more than 4096 elements inductor's C++ kernels use a
cascade-sum helper, and with symbolic sizes inductor guards that choice on the
example's length: a graph compiled for a small batch compiles again for one whose
summed length passes 4096, and the other way round. The patch
(``petfunc/_torch/sum_helper.py``) makes the choice without a guard, so one graph
serves every batch, as ``petfunc.compile`` promises.

Each variant runs in a fresh process with an empty inductor cache and no trace
cache: the benchmark's compiled qm9 training step (energies only, float32, the
default PET; ``train_step.py``), compiled on a batch of 8 molecules, then given
that batch, one of 80 molecules and another of 8. Printed per variant: each call's
time and the graphs compiled so far (a recompile shows as a call of seconds).
The forces-and-stress step of the carbon set compiles one graph either way: its
long sums are not float32 sums over one symbolic length.

    PETFUNC_BENCH_DATA=... python benchmarks/recompiles.py --threads 2 \
        [--variants default off:unguarded_sum_helper stock]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent


def child(threads: int) -> None:
    import torch

    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(0, str(HERE))
    from train_step import setup

    import petfunc

    torch.set_num_threads(threads)
    bench = setup("qm9", torch.float32, 11)
    composition = bench.params["composition_weights"].tolist()
    scale = float(bench.params["energy_scale"])
    large = petfunc.data.make_batch(
        [sample for chunk in bench.samples[1:] for sample in chunk],
        bench.config,
        composition,
        scale,
        dtype=torch.float32,
    )
    compiled = petfunc.compile(bench.step, bench.state, bench.batches[0], donate_argnums=(0,))
    state = bench.state
    rows = []
    for name, batch in (("8 molecules", bench.batches[0]), ("80", large), ("8 others", bench.batches[1])):
        start = time.perf_counter()
        state, _ = compiled(state, batch)
        atoms = batch.positions.shape[0]
        rows.append(
            {
                "batch": f"{name} ({atoms} atoms)",
                "seconds": time.perf_counter() - start,
                "graphs": compiled.num_graphs,
            }
        )
    print(json.dumps(rows))


def run(variant: str, threads: int) -> list:
    off = {} if variant == "default" else {"PETFUNC_STOCK_TORCH": "1"} if variant == "stock" else None
    if off is None:
        off = {"PETFUNC_PATCHES_OFF": variant[len("off:") :]}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, PETFUNC_TRACE_CACHE="0", **off)
        out = subprocess.run(
            [sys.executable, __file__, "--child", "--threads", str(threads)],
            env=env,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["default", "off:unguarded_sum_helper"])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        child(args.threads)
        return
    results = {variant: run(variant, args.threads) for variant in args.variants}
    names = [row["batch"] for row in next(iter(results.values()))]
    print("| variant | " + " | ".join(names) + " | graphs |")
    print("|---|" + "---|" * (len(names) + 1))
    for variant, rows in results.items():
        cells = [f"{row['seconds']:.1f} s ({row['graphs']})" for row in rows]
        print(f"| {variant} | " + " | ".join(cells) + f" | {rows[-1]['graphs']} |")


if __name__ == "__main__":
    main()
