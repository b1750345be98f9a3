"""Cold compile time of the training step: what kernel grouping and the direct
inductor path save.

Each measurement is a fresh process with an empty inductor cache and no trace
cache: ``petfunc.compile`` of the default PET's training step (the setting of
``train_step.py``: batch 8, float32; qm9 energy only, carbon energy + forces +
stress), then its first call. Variants, interleaved (A B A B ...):

* ``separate``: inductor builds each C++ kernel alone (``PETFUNC_GROUP_KERNELS=0``);
* ``grouped``: kernels built a few per library (the ``kernel_groups`` patch,
  petfunc's default);
* ``aot``: grouped, but the graph goes to inductor through AOTAutograd's two
  re-traces, as torch.compile's backend does (``PETFUNC_DIRECT_INDUCTOR=0``;
  petfunc's default is one functionalizing re-trace, see
  ``petfunc.compile.inductor.compile_inductor_direct``);
* ``late_probe``: grouped, but inductor probes the CPU's vector instruction sets
  when it first needs them, not in the background while ``make_fx`` traces
  (``PETFUNC_EARLY_ISA_PROBE=0``; see :mod:`petfunc.compile.isa_probe`);
* ``simplify``: grouped, but inductor's vectorization analysis runs
  ``sympy.simplify`` on every index (the ``fast_strides`` patch off; petfunc's
  default expands polynomial indices instead);
* ``late_split``: grouped, but CPU ``addmm`` is split after inductor's passes have
  merged ``mm + add``, not before them (the ``addmm_merge_hold`` patch off);
* ``no_lofa``, ``no_asserts``: grouped, with inductor's loop reordering after
  fusion off, or without the size, alignment and scalar assertions in its
  generated code (both tried and not kept: no faster);
* ``stock``: every patch of torch internals off (``PETFUNC_STOCK_TORCH=1``);
* ``off:NAME[,NAME...]``: grouped, with the named patches of
  ``patches()`` of :mod:`petfunc.compile` off (``PETFUNC_PATCHES_OFF``), for any patch:
  ``off:unguarded_sum_helper``, ``off:addmm_split``, ...

Also printed: the median step time of each variant over the other batches, so that
a compile-time gain that costs step time would show. ``--compare-with CHECKOUT``
runs each variant with another checkout's petfunc too (interleaved), for a
before/after comparison of a change:

    python benchmarks/cold_compile.py --dataset qm9 --repeats 2
    git worktree add /tmp/before <commit>
    python benchmarks/cold_compile.py --variants grouped --compare-with /tmp/before
    python benchmarks/cold_compile.py --variants grouped aot --repeats 2
    python benchmarks/cold_compile.py --dataset carbon --variants grouped late_split --repeats 4
    python benchmarks/cold_compile.py --variants grouped stock off:fast_strides --repeats 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


HERE = Path(__file__).resolve().parent
# the datasets every child reads (see train_step.DATA), whichever checkout it runs
DATA = Path(os.environ.get("PETFUNC_BENCH_DATA") or HERE.parent.parent / "shared" / "data")
# environment of each variant's process
VARIANTS = {
    "separate": {"PETFUNC_GROUP_KERNELS": "0"},
    "grouped": {"PETFUNC_GROUP_KERNELS": "1"},
    "aot": {"PETFUNC_GROUP_KERNELS": "1", "PETFUNC_DIRECT_INDUCTOR": "0"},
    "simplify": {"PETFUNC_GROUP_KERNELS": "1", "PETFUNC_FAST_STRIDES": "0"},
    "late_probe": {"PETFUNC_GROUP_KERNELS": "1", "PETFUNC_EARLY_ISA_PROBE": "0"},
    "late_split": {"PETFUNC_GROUP_KERNELS": "1", "PETFUNC_EARLY_ADDMM_SPLIT": "0"},
    "no_lofa": {"PETFUNC_GROUP_KERNELS": "1", "TORCHINDUCTOR_LOOP_ORDERING_AFTER_FUSION": "0"},
    "no_asserts": {
        "PETFUNC_GROUP_KERNELS": "1",
        "TORCHINDUCTOR_SIZE_ASSERTS": "0",
        "TORCHINDUCTOR_ALIGNMENT_ASSERTS": "0",
        "TORCHINDUCTOR_SCALAR_ASSERTS": "0",
    },
    "stock": {"PETFUNC_STOCK_TORCH": "1"},
}


def variant_environment(variant: str) -> dict:
    """The environment of ``variant``: one of :data:`VARIANTS`, or ``off:NAME,...``
    (those patches off, kernel groups on unless named)."""
    if variant.startswith("off:"):
        return {"PETFUNC_GROUP_KERNELS": "1", "PETFUNC_PATCHES_OFF": variant[len("off:") :]}
    return VARIANTS[variant]


def variant_name(text: str) -> str:
    """``text`` if it names a variant (for argparse)."""
    if text in VARIANTS or (text.startswith("off:") and len(text) > len("off:")):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(VARIANTS)}, or off:NAME[,NAME...]")


def child(dataset: str, variant: str, threads: int) -> None:
    import torch

    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    from train_step import setup

    import petfunc

    torch.set_num_threads(threads)
    bench = setup(dataset, torch.float32, 9)
    step, state, batches = bench.step, bench.state, bench.batches

    start = time.perf_counter()
    # the step `petfunc train` compiles: its state donated, trained step after step
    compiled = petfunc.compile(step, state, batches[0], donate_argnums=(0,))
    traced = time.perf_counter()
    state, _ = compiled(state, batches[0])
    done = time.perf_counter()
    times = []
    for _ in range(2):
        for batch in batches[1:]:
            t = time.perf_counter()
            state, _ = compiled(state, batch)
            times.append(time.perf_counter() - t)
    nodes = sum(1 for n in compiled.graph.graph.nodes if n.op == "call_function")
    print(
        json.dumps(
            {
                "trace": traced - start,
                "compile": done - traced,
                "total": done - start,
                "step_ms": 1e3 * statistics.median(times),
                "nodes": nodes,
                "graphs": compiled.num_graphs,
            }
        )
    )


def measure(dataset: str, variant: str, threads: int, checkout: Path = HERE.parent) -> dict:
    """One fresh process of ``checkout``'s petfunc (this one, or ``--compare-with``)."""
    script = checkout / "benchmarks" / "cold_compile.py"
    with tempfile.TemporaryDirectory() as cache:
        env = dict(
            os.environ,
            TORCHINDUCTOR_CACHE_DIR=cache,
            PETFUNC_TRACE_CACHE="0",
            PYTHONPATH=str(checkout),
            PETFUNC_BENCH_DATA=str(DATA),
            **variant_environment(variant),
        )
        out = subprocess.run(
            [sys.executable, str(script), "--child", dataset, variant, "--threads", str(threads)],
            env=env,
            capture_output=True,
            text=True,
        )
    if out.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dataset", choices=["qm9", "carbon"], default="qm9")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", type=variant_name, default=["separate", "grouped"])
    parser.add_argument(
        "--compare-with",
        type=Path,
        metavar="CHECKOUT",
        help="also run each variant with the petfunc of another checkout (for example a "
        "git worktree of an earlier commit), interleaved",
    )
    parser.add_argument("--child", nargs=2, metavar=("DATASET", "VARIANT"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        return child(*args.child, args.threads)
    print(
        f"## {args.dataset}: cold compile of the training step (fresh process, empty caches), "
        f"{args.threads} threads"
    )
    checkouts = {"": HERE.parent}
    if args.compare_with:
        checkouts = {"other ": args.compare_with.resolve(), "this ": HERE.parent}
        other_bench = args.compare_with / "benchmarks" / "train_step.py"
        if "PETFUNC_BENCH_DATA" not in other_bench.read_text():
            # older benchmarks look for ../shared/data next to their own checkout
            print(
                f"# warning: {args.compare_with} reads its data from its own ../shared/data, not "
                f"{DATA}; link one to the other, or the two runs use different structures"
            )
    runs = [
        (prefix + variant, variant, path) for variant in args.variants for prefix, path in checkouts.items()
    ]
    results = {name: [] for name, _, _ in runs}
    for r in range(args.repeats):
        for name, variant, path in runs:
            result = measure(args.dataset, variant, args.threads, path)
            results[name].append(result)
            print(
                f"# run {r + 1} {name:14s} trace {result['trace']:5.1f} s, compile + first call "
                f"{result['compile']:5.1f} s, total {result['total']:5.1f} s; "
                f"step {result['step_ms']:.1f} ms; "
                f"{result['nodes']} graph nodes, {result['graphs']} graph(s)",
                flush=True,
            )
    print("| variant | trace (s) | compile + first call (s) | total (s) | step (ms) | graphs |")
    print("|---|---|---|---|---|---|")
    for name, measured in results.items():
        med = {k: statistics.median(r[k] for r in measured) for k in ("trace", "compile", "total", "step_ms")}
        graphs = max(r["graphs"] for r in measured)
        print(
            f"| {name} | {med['trace']:.1f} | {med['compile']:.1f} | {med['total']:.1f} "
            f"| {med['step_ms']:.1f} | {graphs} |"
        )


if __name__ == "__main__":
    main()
