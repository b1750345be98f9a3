"""Memory and time of the eager ASE calculator on large cells: glibc, keep, remat.

Each variant runs in its own process (peak resident memory is per process), on
the same diamond supercell (rattled; default PET, float32, energy + forces +
stress), variants alternating, ``--rounds`` times:

* ``glibc``: ``PETCalculator(keep_freed_memory=False)``, glibc's malloc defaults:
  every step's large blocks are fresh mmaps, page-faulted in again;
* ``keep``: the calculator's default, ``keep_freed_memory=True``
  (:func:`petfunc.allocator.keep_freed_memory`);
* ``remat``: ``PETCalculator(remat=True)`` (:func:`petfunc.remat`, transformer
  layers recomputed in the backward pass), glibc defaults;
* ``remat+keep``: both.

Printed per system and variant: the median step time, the peak resident set size
of the process (``ru_maxrss``: torch's own ~0.4 GiB included), its rise over the
size before the first step, and the activations autograd keeps for the backward
pass (unique storages seen by a saved-tensor hook, MiB; exact, not timed).

With ``--train``, the same for one eager training step (``petfunc.make_train_step``
with ``autodiff="autograd"``, energy + forces + stress loss, Adam) on a batch of
``--batch`` copies of the cell (random labels): variants ``glibc`` and
``remat`` (``petfunc.remat`` around the step, as ``remat: true`` in
``petfunc train``), each with glibc's defaults, and ``keep`` and ``remat+keep``.

    python benchmarks/memory.py --threads 2                    # C64 and C512
    python benchmarks/memory.py --threads 2 --systems C1728    # ~5 minutes
    python benchmarks/memory.py --threads 2 --train --systems C64 --batch 8
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {
    "glibc": {"keep_freed_memory": False},
    "keep": {},
    "remat": {"remat": True},
    "remat+keep": {"remat": True, "keep_freed_memory": True},
}
SYSTEMS = {"C64": 2, "C512": 4, "C1728": 6, "C4096": 8}


def _rss_mib() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def worker(args) -> None:
    import ase.build
    import numpy as np
    import torch

    import petfunc
    from petfunc.ase import PETCalculator

    torch.set_num_threads(args.threads)
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    params = petfunc.init(config, seed=0, dtype=torch.float32)
    atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat((SYSTEMS[args.worker_system],) * 3)
    atoms.rattle(0.05, seed=0)
    calc = PETCalculator(config, params, **VARIANTS[args.worker])
    atoms.calc = calc
    rng = np.random.default_rng(0)

    def step():
        atoms.positions += rng.normal(0.0, 0.01, atoms.positions.shape)
        atoms.get_forces()
        atoms.get_stress()
        return float(atoms.get_potential_energy())

    _measure_worker(step, args.steps, len(atoms))


def _measure_worker(step, steps: int, atoms: int) -> None:
    """Print the JSON line of one variant: ``step()`` once under a saved-tensor hook
    (the bytes autograd keeps), once untimed, then ``steps`` timed calls."""
    from petfunc.remat import saved_tensor_bytes

    before = _rss_mib()
    value, saved = saved_tensor_bytes(step)
    times = []
    for index in range(1 + steps):  # one untimed step
        start = time.perf_counter()
        value = step()
        if index:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    print(
        json.dumps(
            {
                "time_ms": 1e3 * statistics.median(times),
                "peak_mib": peak,
                "rise_mib": peak - before,
                "saved_mib": saved / 2**20,
                "atoms": atoms,
                "energy": value,
            }
        )
    )


def train_worker(args) -> None:
    import ase.build
    import numpy as np
    import torch

    import petfunc
    from petfunc import allocator
    from petfunc.data import sample_from_atoms

    torch.set_num_threads(args.threads)
    variant = VARIANTS[args.worker]
    if variant.get("keep_freed_memory", not variant.get("remat", False)):
        allocator.keep_freed_memory()
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=torch.float32)
    rng = np.random.default_rng(0)
    samples = []
    for index in range(args.batch):
        atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat((SYSTEMS[args.worker_system],) * 3)
        atoms.rattle(0.05, seed=index)
        atoms.info["energy"] = float(rng.normal()) * len(atoms)
        atoms.arrays["forces"] = rng.normal(size=(len(atoms), 3))
        atoms.info["stress"] = rng.normal(size=6) * 1e-2
        samples.append(sample_from_atoms(atoms, config))
    batch = petfunc.make_batch(samples, config, [0.0] * 4, 1.0, dtype=torch.float32)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-4, 100, 0.0))
    weights = petfunc.LossWeights.make(forces=0.0, stress=0.0) if args.energy_only else petfunc.LossWeights()
    step = petfunc.make_train_step(model, optimizer, weights, autodiff="autograd")
    if variant.get("remat"):
        step = petfunc.remat(step)
    state = petfunc.init_state(params, optimizer)

    def train_step():
        _, metrics = step(state, batch)  # the same state every time: comparable steps
        return float(metrics["loss"])

    _measure_worker(train_step, args.steps, int(batch.positions.shape[0]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--systems", nargs="+", default=["C64", "C512"], choices=list(SYSTEMS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process")
    parser.add_argument("--rounds", type=int, default=1, help="processes per variant (alternating)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument(
        "--train", action="store_true", help="an eager training step instead of the calculator"
    )
    parser.add_argument("--batch", type=int, default=8, help="cells per training batch (--train)")
    parser.add_argument("--energy-only", action="store_true", help="an energy-only loss (--train)")
    parser.add_argument("--worker", choices=list(VARIANTS), help=argparse.SUPPRESS)
    parser.add_argument("--worker-system", choices=list(SYSTEMS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        (train_worker if args.train else worker)(args)
        return

    what = f"eager training step on {args.batch} cells" if args.train else "eager PETCalculator"
    print(
        f"# {what}, default PET, float32, E + F + stress, {args.threads} threads, "
        f"{args.steps} timed steps per process, {args.rounds} process(es) per variant"
    )
    print(
        f"{'system':8} {'variant':11} {'step (ms)':>10} {'vs keep':>8} {'peak RSS (MiB)':>15} "
        f"{'rise (MiB)':>11} {'saved (MiB)':>12}"
    )
    for system in args.systems:
        results = {name: [] for name in args.variants}
        for _ in range(args.rounds):
            for name in args.variants:
                command = [
                    sys.executable,
                    __file__,
                    "--worker",
                    name,
                    "--worker-system",
                    system,
                    "--steps",
                    str(args.steps),
                    "--threads",
                    str(args.threads),
                    "--batch",
                    str(args.batch),
                ]
                command += (["--train"] if args.train else []) + (
                    ["--energy-only"] if args.energy_only else []
                )
                out = subprocess.run(command, check=True, capture_output=True, text=True).stdout
                results[name].append(json.loads(out.strip().splitlines()[-1]))
        summary = {
            name: {key: statistics.median(r[key] for r in runs) for key in runs[0]}
            for name, runs in results.items()
        }
        reference = summary.get("keep", next(iter(summary.values())))
        energies = {round(s["energy"], 6) for s in summary.values()}  # the loss with --train
        for name, s in summary.items():
            print(
                f"{system:8} {name:11} {s['time_ms']:10.0f} {s['time_ms'] / reference['time_ms']:7.2f}x "
                f"{s['peak_mib']:15.0f} {s['rise_mib']:11.0f} {s['saved_mib']:12.0f}"
            )
        print(
            f"# {system}: {int(reference['atoms'])} atoms; {'losses' if args.train else 'energies'} "
            f"of the variants: {sorted(energies)}"
        )


if __name__ == "__main__":
    main()
