"""Compile time of petfunc.compile's path vs torch.compile of the same traced graph.

* ``petfunc``: :func:`petfunc.compile` (the backend gets the ``make_fx`` graph and
  symbolic fake inputs directly);
* ``dynamo``: ``torch.compile(graph, dynamic=True, fullgraph=True)`` of the same
  ``make_fx`` graph (Dynamo re-traces the graph before handing it to inductor), the
  path petfunc used before.

Each measurement runs in a fresh process. "cold" starts from an empty inductor cache
(its own ``TORCHINDUCTOR_CACHE_DIR`` per path), "warm" is a second process on that
cache. The function is the ASE calculator's energy + per-atom energies + forces +
strain derivative of a PET on an 8-atom diamond cell; both compiled functions are
checked against the traced graph on a 16-atom cell.

    python benchmarks/compile_time.py                 # d_pet 32
    python benchmarks/compile_time.py --d-pet 128     # the default PET (slower)
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def child(path: str, d_pet: int, threads: int) -> None:
    import ase.build
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import petfunc
    from petfunc.ase import PETCalculator
    from petfunc.compile import Compiled, no_duck_shape

    torch.set_num_threads(threads)
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), d_pet=d_pet)
    params = petfunc.init(config, seed=0, dtype=torch.float32)
    calc = PETCalculator(config, params)

    def inputs(repeat):
        atoms = ase.build.bulk("C", "diamond", a=3.567, cubic=True).repeat(repeat)
        atoms.rattle(0.05, seed=0)
        return calc._inputs(atoms)

    small, large = inputs((1, 1, 1)), inputs((2, 1, 1))
    start = time.perf_counter()
    compiled = Compiled(calc._efs, (calc.params, *small))
    traced = time.perf_counter()
    if path == "petfunc":
        run = lambda x: compiled(calc.params, *x)  # noqa: E731
    else:
        dynamo = torch.compile(compiled.graph, dynamic=True, fullgraph=True)

        def run(x):
            flat = compiled.call_inputs(compiled.checked_tensors((calc.params, *x)))[0]
            with torch.no_grad(), no_duck_shape():
                return dynamo(*flat)

    run(small)
    done = time.perf_counter()
    expected = compiled.eager_graph(calc.params, *large)
    got = run(large)
    error = max(float((a - b).abs().max()) for a, b in zip(got, expected))
    print(f"RESULT {traced - start:.1f} {done - traced:.1f} {error:.1e}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--d-pet", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child, args.d_pet, args.threads)
        return
    print(f"PET d_pet {args.d_pet}, energy + forces + strain derivative, {args.threads} threads")
    print(f"{'path':<8} {'cache':<5} {'make_fx (s)':>12} {'compile + 1st call (s)':>23} {'max |diff|':>11}")
    with tempfile.TemporaryDirectory() as scratch:
        for cache in ("cold", "warm"):
            for path in ("dynamo", "petfunc"):
                env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=os.path.join(scratch, path))
                out = subprocess.run(
                    [
                        sys.executable,
                        __file__,
                        "--child",
                        path,
                        "--d-pet",
                        str(args.d_pet),
                        "--threads",
                        str(args.threads),
                    ],
                    env=env,
                    capture_output=True,
                    text=True,
                )
                line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
                if not line:
                    print(out.stderr[-3000:])
                    raise SystemExit(f"{path} {cache}: failed")
                trace, compile_s, error = line[0].split()[1:]
                print(f"{path:<8} {cache:<5} {trace:>12} {compile_s:>23} {error:>11}", flush=True)


if __name__ == "__main__":
    main()
