"""Compiled training-step time of this checkout against another, in one process.

Step-time changes of a few per cent drown in this machine's noise when each
version runs in its own process at its own time. Here both versions of petfunc are
imported side by side (the other checkout's package under another name), compile
the same step on the same weights, and alternate on the same batches: this, other,
this, other... Each carries its own training state from step to step, as training
does. Prints the median step time of each, their ratio, and the largest difference
of the first step's loss (the two must compute the same function).

    git worktree add /tmp/base <commit>
    python benchmarks/compare_step.py --compare-with /tmp/base [--dataset qm9|carbon]

``--deterministic`` instead compares this checkout with itself run under
``torch.use_deterministic_algorithms(True)`` ("other"), as ``petfunc train`` runs
by default: what reproducible scatter-adds cost.

``--patches-off NAME[,NAME...]`` compares this checkout with itself compiled with
those patches of torch internals off ("other"; names as in
``from petfunc.compile import patches``, ``all`` for every one): what a speed patch gains a
step, for example

    python benchmarks/compare_step.py --patches-off addmm_split --dataset carbon
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import inspect
import os
import statistics
import sys
import time
from pathlib import Path

import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's petfunc, not an installed one
import petfunc


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import add_malloc_option, apply_malloc
from train_step import frames, setup


def import_checkout(path: Path, name: str = "petfunc_other"):
    """The ``petfunc`` package of another checkout, imported as ``name`` beside this
    checkout's ``petfunc``, so that the two do not mix.

    A package whose modules import each other relatively is imported under ``name``
    directly. One whose modules import ``petfunc.…`` absolutely (at module level) is
    imported as ``petfunc`` while this checkout's modules are set aside, then moved
    to ``name``.
    """
    init = path / "petfunc" / "__init__.py"
    if not init.exists():
        raise SystemExit(f"{path} has no petfunc/__init__.py")
    if "from . import" in init.read_text() or "from .config import" in init.read_text():
        locations = [str(init.parent)]
        spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=locations)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        return module

    def ours(key):
        return key == "petfunc" or key.startswith("petfunc.")

    mine = {k: sys.modules.pop(k) for k in [k for k in sys.modules if ours(k)]}
    sys.path.insert(0, str(path))
    try:
        module = importlib.import_module("petfunc")
    finally:
        sys.path.remove(str(path))
        theirs = {k: sys.modules.pop(k) for k in [k for k in sys.modules if ours(k)]}
        sys.modules.update(mine)
    sys.modules.update({name + k[len("petfunc") :]: v for k, v in theirs.items()})
    return module


@contextlib.contextmanager
def environment(**settings):
    """``os.environ`` with ``settings`` for a ``with`` block (petfunc reads its
    PETFUNC_* settings when it compiles)."""
    before = {name: os.environ.get(name) for name in settings}
    os.environ.update(settings)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    which = parser.add_mutually_exclusive_group(required=True)
    which.add_argument("--compare-with", type=Path, metavar="CHECKOUT")
    which.add_argument(
        "--deterministic",
        action="store_true",
        help="compare with this checkout under deterministic algorithms",
    )
    which.add_argument(
        "--patches-off",
        metavar="NAME[,NAME...]",
        help="compare with this checkout compiled with these patches of torch internals off "
        "(names of petfunc.compile's patches(); 'all': PETFUNC_STOCK_TORCH=1)",
    )
    parser.add_argument("--dataset", choices=["qm9", "carbon"], default="qm9")
    parser.add_argument(
        "--eager",
        action="store_true",
        help="the eager step `petfunc train` runs without --compile (autograd) instead of the compiled one",
    )
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=4, help="passes over the batches")
    parser.add_argument("--threads", type=int, default=2)
    add_malloc_option(parser)
    args = parser.parse_args(argv)
    apply_malloc(args)
    torch.set_num_threads(args.threads)
    other = petfunc if args.compare_with is None else import_checkout(args.compare_with.resolve())
    structures = frames(args.dataset)

    this = setup(args.dataset, torch.float32, args.batches, structures=structures)
    # the same weights for the other version (copies: the two states train apart)
    that = setup(
        args.dataset,
        torch.float32,
        args.batches,
        pkg=other,
        structures=structures,
        params=petfunc.tree.flatten(this.params),
    )
    versions = {
        label: [b.step, b.state, b.batches, pkg]
        for label, b, pkg in (("this", this, petfunc), ("other", that, other))
    }

    def mode(label):
        """Deterministic algorithms for "other" with --deterministic (at compile time
        inductor then lowers scatter-adds to aten's; at run time aten's are serial);
        the patches named by --patches-off off for "other"."""
        if args.deterministic and label == "other":
            return petfunc.deterministic_algorithms()
        if args.patches_off and label == "other":
            if args.patches_off == "all":
                return environment(PETFUNC_STOCK_TORCH="1")
            return environment(PETFUNC_PATCHES_OFF=args.patches_off)
        return contextlib.nullcontext()

    losses = {}
    for label, v in versions.items():
        step, state, batches, pkg = v
        start = time.perf_counter()
        with mode(label):
            if args.eager:
                b = this if label == "this" else that
                v[0] = pkg.make_train_step(b.model, b.optimizer, b.weights, autodiff="autograd")
            else:
                # donate the state as `petfunc train` does, where the version can
                donate = "donate_argnums" in inspect.signature(pkg.compile).parameters
                v[0] = pkg.compile(step, state, batches[0], **({"donate_argnums": (0,)} if donate else {}))
            new_state, metrics = v[0](state, batches[0])
        losses[label] = float(metrics["loss"])
        v[1] = new_state
        print(
            f"# {label}: {'first call' if args.eager else 'compile + first call'} "
            f"{time.perf_counter() - start:.1f} s (caches as found)",
            flush=True,
        )
    print(f"# first-step loss: this {losses['this']:.8g}, other {losses['other']:.8g}")

    times = {label: [] for label in versions}
    for _ in range(args.rounds):
        for i in range(args.batches):
            for label, v in versions.items():
                with mode(label):
                    start = time.perf_counter()
                    v[1], _ = v[0](v[1], v[2][i])
                    times[label].append(time.perf_counter() - start)
    med = {label: 1e3 * statistics.median(t) for label, t in times.items()}
    graphs = {label: getattr(v[0], "num_graphs", "no") for label, v in versions.items()}
    kind = "eager (autograd)" if args.eager else "compiled"
    print(f"## {args.dataset}: {kind} step, {args.rounds} x {args.batches} batches, interleaved")
    for label in versions:
        print(f"| {label} | {med[label]:.1f} ms | {graphs[label]} graph(s) |")
    print(f"# this / other: {med['this'] / med['other']:.3f}")


if __name__ == "__main__":
    main()
