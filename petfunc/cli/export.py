"""``petfunc export``: a model's energy, forces and strain derivative as a PT2 archive
(a torch.export program and its AOTInductor build; see ``docs/deployment.md``)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from petfunc.cli.arguments import add_threads
from petfunc.devices import resolve_device
from petfunc.export import default_aoti, export
from petfunc.io import is_llpr_checkpoint, load_model


def add_parser(subparsers) -> None:
    """The ``export`` command and its flags."""
    ex = subparsers.add_parser(
        "export",
        help="write a deployment artifact (.pt2)",
        description="Export energy, per-atom energies, forces and strain derivative of a model, "
        "weights included, as a PT2 archive: a torch.export program and (default) its "
        "AOTInductor build. Load it with petfunc.export.load or "
        "PETCalculator.from_exported; see `python -m pydoc petfunc.export`.",
    )
    ex.add_argument(
        "model", help="a petfunc checkpoint (.ckpt), a best_params.pt file, or a metatrain checkpoint"
    )
    ex.add_argument("output", help="the artifact to write (must end in .pt2)")
    ex.add_argument("--dtype", choices=("float32", "float64"), default="float32")
    ex.add_argument("--device", default="cpu", help="cpu or cuda: the AOTInductor build runs there only")
    ex.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="parameters of a training checkpoint (default: best)",
    )
    aoti = ex.add_mutually_exclusive_group()
    aoti.add_argument(
        "--aoti",
        dest="aoti",
        action="store_true",
        default=None,
        help="also the AOTInductor build (the default on the CPU; on a GPU see the README)",
    )
    aoti.add_argument(
        "--no-aoti",
        dest="aoti",
        action="store_false",
        help="only the torch.export program (seconds instead of minutes; no C++ compiler needed; "
        "the default for a GPU)",
    )
    ex.add_argument(
        "--long-range",
        choices=("p3m", "ewald"),
        default=None,
        help="reciprocal-space method of a long-range model: p3m (default; only the "
        "first structure of a call may be periodic) or ewald (batches of crystals)",
    )
    add_threads(ex)


def run(args: argparse.Namespace) -> int:
    """Run ``petfunc export`` with the parsed ``args``; returns the exit status."""
    if not args.output.endswith(".pt2"):
        raise ValueError(f"the output file name must end in .pt2, got {args.output!r}")
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    device = resolve_device(args.device, "--device")
    config, params = load_model(args.model, which=args.which)
    aoti = default_aoti(device, config, args.long_range) if args.aoti is None else args.aoti
    what = (
        "torch.export program and AOTInductor build (this takes minutes)" if aoti else "torch.export program"
    )
    lr = f", long range by {args.long_range or 'p3m'}" if config.long_range.enable else ""
    print(f"exporting {args.model} ({args.dtype}, {args.device}{lr}): {what}")
    if is_llpr_checkpoint(args.model):
        print(
            f"petfunc: note: {args.model} is an LLPR checkpoint: the export holds its PET (energy, forces, "
            "stress), not the uncertainty; PETCalculator.from_metatrain(path) gives both",
            file=sys.stderr,
        )
    start = time.perf_counter()
    if args.long_range and not config.long_range.enable:
        raise ValueError(f"--long-range {args.long_range}: {args.model} has no long-range features")
    path = export(
        config, params, args.output, dtype=dtype, device=device, aoti=aoti, long_range=args.long_range
    )
    size = path.stat().st_size / 2**20
    print(f"wrote {path} ({size:.1f} MiB) in {time.perf_counter() - start:.0f} s")
    return 0
