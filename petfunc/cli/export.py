"""``petfunc export``: a model as a metatomic model (``.pt``: LAMMPS, i-PI, ASE and
torch-sim through metatomic), a metatrain checkpoint (``.ckpt``), or petfunc's PT2
archive (``.pt2``: a torch.export program and its AOTInductor build); see
``docs/deployment.md``."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from petfunc.cli.arguments import add_threads
from petfunc.devices import resolve_device
from petfunc.export import FORMATS, default_aoti, export, export_metatomic, format_of
from petfunc.io import is_llpr_checkpoint, load_model, save_metatrain


def add_parser(subparsers) -> None:
    """The ``export`` command and its flags."""
    ex = subparsers.add_parser(
        "export",
        help="write a model for simulation engines (.pt), metatrain (.ckpt) or AOTInductor (.pt2)",
        description="Write a model, weights included, in the format its file name says: "
        ".pt, a metatomic model (what `mtt export` writes: LAMMPS, i-PI, ASE through "
        "metatomic-ase, torch-sim; needs the metatrain extra); .ckpt, a metatrain checkpoint "
        "(`mtt export`, `mtt train --restart`); .pt2, petfunc's PT2 archive of energy, "
        "per-atom energies, forces and strain derivative (a torch.export program and, by "
        "default on the CPU, its AOTInductor build; load it with petfunc.export.load or "
        "PETCalculator.from_exported). See docs/deployment.md.",
    )
    ex.add_argument(
        "model", help="a petfunc checkpoint (.ckpt), a best_params.pt file, or a metatrain checkpoint"
    )
    ex.add_argument(
        "output",
        nargs="?",
        help="the file to write (or -o); default: the model's name with .pt, as mtt export",
    )
    ex.add_argument("-o", "--output", dest="output_option", metavar="OUTPUT", help="the file to write")
    ex.add_argument(
        "--format",
        choices=tuple(FORMATS),
        default=None,
        help="metatomic (.pt), pt2 (.pt2) or metatrain-checkpoint (.ckpt); default: by the "
        "output's extension",
    )
    ex.add_argument(
        "--dtype",
        choices=("float32", "float64"),
        default=None,
        help="the dtype the model computes in (default: float32 for .pt2, the weights' own otherwise)",
    )
    ex.add_argument(
        "--device",
        default=None,
        help="pt2 only: cpu (default) or cuda; the AOTInductor build runs there only",
    )
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
        help="pt2 only: also the AOTInductor build (the default on the CPU; on a GPU see the README)",
    )
    aoti.add_argument(
        "--no-aoti",
        dest="aoti",
        action="store_false",
        help="pt2 only: the torch.export program alone (seconds instead of minutes; no C++ "
        "compiler needed; the default for a GPU)",
    )
    ex.add_argument(
        "--long-range",
        choices=("p3m", "ewald"),
        default=None,
        help="pt2 only: reciprocal-space method of a long-range model: p3m (default; only the "
        "first structure of a call may be periodic) or ewald (batches of crystals)",
    )
    add_threads(ex)


def output_of(args: argparse.Namespace) -> Path:
    """The file to write: the positional output or ``-o`` (not both); by default the
    model's name with ``.pt`` (as ``mtt export``), never the model file itself."""
    if args.output and args.output_option:
        raise ValueError(f"two output files, {args.output!r} and -o {args.output_option!r}: give one")
    given = args.output or args.output_option
    if given:
        return Path(given)
    extension = FORMATS[args.format or "metatomic"]
    output = Path(Path(args.model).name).with_suffix(extension)
    if output.resolve() == Path(args.model).resolve():
        raise ValueError(f"the default output {str(output)!r} is the model file itself: name another with -o")
    return output


def run(args: argparse.Namespace) -> int:
    """Run ``petfunc export`` with the parsed ``args``; returns the exit status."""
    output = output_of(args)
    kind = format_of(output, args.format)
    pt2_only = {"--device": args.device, "--long-range": args.long_range, "--aoti/--no-aoti": args.aoti}
    given = [flag for flag, value in pt2_only.items() if value is not None]
    if kind != "pt2" and given:
        raise ValueError(f"{', '.join(given)}: options of the .pt2 format, not of {kind} ({str(output)!r})")
    dtype = {"float32": torch.float32, "float64": torch.float64, None: None}[args.dtype]
    if kind == "pt2":
        return _run_pt2(args, output, dtype or torch.float32)
    config, params = load_model(args.model, which=args.which)
    what = "metatomic model" if kind == "metatomic" else "metatrain checkpoint"
    print(f"exporting {args.model} ({args.dtype or 'the weights dtype'}) as a {what}")
    _llpr_note(args.model, "mtt export of the LLPR checkpoint keeps it")
    start = time.perf_counter()
    try:
        if kind == "metatomic":
            export_metatomic(config, params, output, dtype=dtype)
        else:
            save_metatrain(config, params, output, dtype=dtype)
    except ImportError as error:  # the metatrain extra is missing: say so, not a traceback
        raise ValueError(str(error)) from None
    size = output.stat().st_size / 2**20
    print(f"wrote {output} ({size:.1f} MiB) in {time.perf_counter() - start:.0f} s")
    return 0


def _llpr_note(model: str, keeps: str) -> None:
    """A note that an LLPR checkpoint's uncertainty does not go into the file."""
    if is_llpr_checkpoint(model):
        print(
            f"petfunc: note: {model} is an LLPR checkpoint: the export holds its PET (energy, forces, "
            f"stress), not the uncertainty; {keeps}",
            file=sys.stderr,
        )


def _run_pt2(args: argparse.Namespace, output: Path, dtype: torch.dtype) -> int:
    """``petfunc export`` of a PT2 archive."""
    device = resolve_device(args.device or "cpu", "--device")
    config, params = load_model(args.model, which=args.which)
    aoti = default_aoti(device, config, args.long_range) if args.aoti is None else args.aoti
    what = (
        "torch.export program and AOTInductor build (this takes minutes)" if aoti else "torch.export program"
    )
    lr = f", long range by {args.long_range or 'p3m'}" if config.long_range.enable else ""
    print(f"exporting {args.model} ({str(dtype).replace('torch.', '')}, {device}{lr}): {what}")
    _llpr_note(args.model, "PETCalculator.from_metatrain(path) gives both")
    start = time.perf_counter()
    if args.long_range and not config.long_range.enable:
        raise ValueError(f"--long-range {args.long_range}: {args.model} has no long-range features")
    path = export(config, params, output, dtype=dtype, device=device, aoti=aoti, long_range=args.long_range)
    size = path.stat().st_size / 2**20
    print(f"wrote {path} ({size:.1f} MiB) in {time.perf_counter() - start:.0f} s")
    return 0
