"""Timing and memory helpers shared by the benchmarks (Linux: /proc/self)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def _status(field: str) -> float:
    """A ``/proc/self/status`` field in MiB (VmRSS: now, VmHWM: peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 1024.0
    return float("nan")


def reset_peak_memory() -> None:
    """Reset the process's peak resident memory (VmHWM) to its current RSS."""
    try:
        with open("/proc/self/clear_refs", "w") as refs:
            refs.write("5")
    except OSError:
        pass


def add_malloc_option(parser) -> None:
    """``--malloc keep|default`` on a benchmark's argument parser (see :func:`apply_malloc`)."""
    parser.add_argument(
        "--malloc",
        choices=["keep", "default"],
        default="keep",
        help="keep: glibc keeps freed memory for the next step, as the petfunc "
        "command does (petfunc.allocator); it applies to every variant of the run",
    )


def apply_malloc(args) -> None:
    """Apply ``--malloc keep`` (process-wide, so to every variant alike)."""
    if args.malloc == "keep":
        from petfunc.allocator import keep_freed_memory

        keep_freed_memory()


def measure(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, float, object]:
    """``(median seconds, peak extra resident memory in MiB, last result)`` of ``fn()``.

    The memory is the rise of the peak resident set size over the resident size
    before the timed calls (allocator caches included, so an upper bound).
    """
    out = None
    for _ in range(warmup):
        out = fn()
    reset_peak_memory()
    before = _status("VmRSS")
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), max(0.0, _status("VmHWM") - before), out


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    """``(seconds, result)`` of one call (compilations)."""
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def peak_tensor_memory(fn: Callable[[], object]) -> float:
    """Peak of the tensor memory ``fn()`` allocates on top of what exists before it
    (MiB), from the profiler's allocation and free events: the working memory of the
    call, independent of allocator caching and of what other calls left behind
    (:func:`petfunc.hessian.working_memory`, on CPU)."""
    from petfunc.hessian import working_memory

    return working_memory(fn) / 2**20


def emt_carbon_frames(n: int = 64, alternate_size: bool = False):
    """Labelled stand-ins for carbon_reduced_100 when ../shared/data is missing.

    Rattled diamond cells (2x1x1 primitive cells of 4 atoms, or 4 and 8 atoms
    alternately) with EMT energy, forces
    (``force``) and virial, the keys of the carbon dataset.
    """
    import ase.build
    from ase.calculators.emt import EMT

    frames = []
    for i in range(n):
        atoms = ase.build.bulk("C", "diamond", a=3.57).repeat((2, 1 + (i % 2 if alternate_size else 0), 1))
        atoms.rattle(0.1, seed=i)
        atoms.calc = EMT()
        atoms.info["energy"] = atoms.get_potential_energy()
        atoms.arrays["force"] = atoms.get_forces()
        atoms.info["virial"] = -atoms.get_stress(voigt=False) * atoms.get_volume()
        atoms.calc = None
        frames.append(atoms)
    return frames


def g2_molecules(n: int, rattle: float, seed: int = 0):
    """``n`` rattled G2 molecules of H, C, N and O with at least 3 atoms (the batched
    relaxation and MD benchmarks)."""
    import ase.build
    import numpy as np
    from ase.collections import g2

    names = [name for name in g2.names if set(g2[name].numbers) <= {1, 6, 7, 8} and len(g2[name]) >= 3]
    rng = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        atoms = ase.build.molecule(names[rng.integers(len(names))])
        atoms.rattle(rattle, seed=i)
        frames.append(atoms)
    return frames


def batched_vs_loop_parser(description: str, steps: int):
    """The options the batched relaxation and MD benchmarks share (``--structures``,
    ``--steps``, ``--threads``, ``--repeats``, ``--d-pet``, ``--compile``)."""
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--structures", type=int, default=32)
    parser.add_argument("--steps", type=int, default=steps)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--d-pet", type=int, default=128)
    parser.add_argument("--compile", action="store_true", help="compile both (inductor)")
    return parser


def batched_vs_loop(args):
    """The setup the batched relaxation and MD benchmarks share: torch threads, glibc
    keeping freed memory, and a float32 PET of width ``args.d_pet`` for H, C, N, O
    (``args`` from :func:`batched_vs_loop_parser`). Returns ``(config, params)``."""
    import torch

    import petfunc

    torch.set_num_threads(args.threads)
    petfunc.allocator.keep_freed_memory()
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), d_pet=args.d_pet, d_node=2 * args.d_pet)
    return config, petfunc.PET(config).init(seed=0, dtype=torch.float32)


def interleaved(variants: dict, repeats: int):
    """A first (untimed, compiling) call of each variant, then ``repeats`` rounds
    A B A B. Returns ``(outputs of the last round, {name: [seconds]})`` and prints
    the median table, speed-ups against the first variant."""
    outputs = {name: fn() for name, fn in variants.items()}
    times = {name: [] for name in variants}
    for _ in range(repeats):
        for name, fn in variants.items():
            start = time.perf_counter()
            outputs[name] = fn()
            times[name].append(time.perf_counter() - start)
    base = statistics.median(next(iter(times.values())))
    print("| variant | median s | speed-up |")
    print("|---|---|---|")
    for name, t in times.items():
        print(f"| {name} | {statistics.median(t):.2f} | {base / statistics.median(t):.2f}x |")
    return outputs, times
