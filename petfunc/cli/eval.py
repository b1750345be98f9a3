"""``petfunc eval``: the RMSE and MAE of a model on a labelled extxyz file, its label
keys and units by default those the model was trained on, or on the datasets of a
YAML file in metatrain's dataset layout (``mtt eval MODEL options.yaml``;
:mod:`petfunc.cli.datasets`); optionally each structure's predictions as extxyz."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

import torch

from petfunc.cli.arguments import add_threads, positive_int
from petfunc.cli.datasets import is_dataset_file, numbered, read_dataset_file
from petfunc.devices import resolve_device
from petfunc.trainer import evaluate, training_label_options
from petfunc.trainer.runlog import console


log = logging.getLogger(__name__)


def add_parser(subparsers) -> None:
    """The ``eval`` command and its flags."""
    ev = subparsers.add_parser(
        "eval",
        help="errors of a model on a dataset",
        description="RMSE and MAE of energies per atom, forces and stress.",
    )
    ev.add_argument(
        "model", help="a petfunc checkpoint (.ckpt), a best_params.pt file, or a metatrain checkpoint"
    )
    ev.add_argument(
        "dataset",
        help="extxyz file with reference labels, or a YAML file of metatrain's dataset section(s) "
        "(systems, targets: keys and units; as mtt eval reads)",
    )
    ev.add_argument("--batch-size", type=positive_int, default=16, help="structures per batch (default 16)")
    # metatrain's spelling, an argument of its own so that errors name the flag given
    ev.add_argument(
        "-b", dest="batch_size", type=positive_int, default=argparse.SUPPRESS, help="the same as --batch-size"
    )
    ev.add_argument("--dtype", choices=("float32", "float64"), help="default: the model's")
    ev.add_argument(
        "--device", default="auto", help="auto (default: CUDA when visible), cpu, cuda (or gpu) or cuda:N"
    )
    ev.add_argument(
        "--which",
        choices=("best", "last"),
        default="best",
        help="parameters of a training checkpoint (default: best)",
    )
    labels = "(default: as the model was trained, else {})"
    ev.add_argument("--energy-key", help=labels.format("energy"))
    ev.add_argument("--forces-key", help=labels.format("forces"))
    ev.add_argument("--stress-key", help=labels.format("stress"))
    ev.add_argument(
        "--virial-key",
        help="atoms.info key of virial labels W, compared as the stress -W/V " + labels.format("none"),
    )
    ev.add_argument(
        "--charge-key",
        default=None,
        help="atoms.info key of the total charge (conditioned models; default: charge)",
    )
    ev.add_argument(
        "--spin-key",
        default=None,
        help="atoms.info key of the spin multiplicity (conditioned models; "
        "default: spin_multiplicity, else spin)",
    )
    ev.add_argument("--energy-unit", help="unit of the file's energies " + labels.format("eV"))
    ev.add_argument("--length-unit", help="unit of the file's lengths " + labels.format("angstrom"))
    ev.add_argument(
        "--target",
        metavar="NAME",
        help="energy target of a metatrain checkpoint with several (default: 'energy')",
    )
    ev.add_argument("--json", metavar="FILE", help="also write the metrics as JSON")
    ev.add_argument(
        "--output",
        "-o",
        metavar="FILE",
        help="also write the predictions as extxyz (energy, forces, stress of each structure), in the "
        "units the file was read in (--energy-unit, --length-unit); with several datasets in a YAML "
        "file, FILE_0.xyz, FILE_1.xyz, ...",
    )
    add_threads(ev)


LABEL_DEFAULTS = {
    "energy_key": "energy",
    "forces_key": "forces",
    "stress_key": "stress",
    "virial_key": None,
    "energy_unit": "eV",
    "length_unit": "angstrom",
}


def label_options(args) -> None:
    """Fill the label keys and units ``petfunc eval`` was not given: from the first
    training file of a petfunc checkpoint's options (a model trained on ``U0`` in
    kcal/mol is evaluated on ``U0`` in kcal/mol), the units of a metatrain model's
    training data, else the defaults."""
    missing = [name for name in LABEL_DEFAULTS if getattr(args, name) is None]
    trained = training_label_options(args.model, args.target) if missing else {}
    taken = []
    for name in missing:
        value = trained.get(name, LABEL_DEFAULTS[name])
        setattr(args, name, value)
        if value != LABEL_DEFAULTS[name]:
            taken.append(f"{name.replace('_', ' ')} {value!r}")
    if taken:
        # say which keys go with the units taken: a metatrain model stores its units but
        # not its keys, and a file whose default keys hold labels in other units would
        # otherwise give wrong errors without a word
        keys = [
            f"{name.split('_')[0]} {getattr(args, name)!r}"
            for name in ("energy_key", "forces_key", "stress_key", "virial_key")
            if getattr(args, name)
        ]
        log.info(
            "labels read as the model was trained: "
            + ", ".join(taken)
            + "; keys "
            + ", ".join(keys)
            + " (--energy-unit, --length-unit and the --*-key options override)"
        )


#: the flags of the labels, which a dataset file sets instead
LABEL_FLAGS = {
    "energy_key": "--energy-key",
    "forces_key": "--forces-key",
    "stress_key": "--stress-key",
    "virial_key": "--virial-key",
    "charge_key": "--charge-key",
    "spin_key": "--spin-key",
    "energy_unit": "--energy-unit",
    "length_unit": "--length-unit",
}


def run(args: argparse.Namespace) -> int:
    """Run ``petfunc eval`` with the parsed ``args``; returns the exit status. Its
    lines go through the ``petfunc.cli.eval`` logger: to stdout, warnings to stderr."""
    with console(print, lambda message: print(message, file=sys.stderr)):
        return evaluate_command(args)


def evaluate_command(args: argparse.Namespace) -> int:
    """:func:`run` without the console."""
    device = resolve_device(args.device, "--device")
    if is_dataset_file(args.dataset):
        given = [flag for name, flag in LABEL_FLAGS.items() if getattr(args, name) is not None]
        if given:
            raise ValueError(
                f"{', '.join(given)}: the labels of the dataset file {args.dataset!r} are set in it "
                "(targets: key, unit, forces, stress, virial; systems: length_unit), not by flags"
            )
        datasets = read_dataset_file(args.dataset)
        output, json_path = args.output, args.json
        for index, dataset in enumerate(datasets):
            for name, value in dataset.labels.items():
                setattr(args, name, value)
            args.output = numbered(output, index, len(datasets))
            args.json = numbered(json_path, index, len(datasets))
            evaluate_file(args, dataset.read_from, device, dataset.required)
            for name in LABEL_FLAGS:  # the next dataset's labels are its own
                setattr(args, name, None)
        return 0
    # keys given on the command line must be in the file; defaults may be absent
    named = [
        getattr(args, name)
        for name in ("energy_key", "forces_key", "stress_key", "virial_key")
        if getattr(args, name) is not None
    ]
    if args.stress_key is not None and args.virial_key is not None:
        # two labels of one quantity (metatrain's options refuse them too): one of
        # them would be ignored without a word
        raise ValueError("give --stress-key or --virial-key, not both: they label the same quantity")
    evaluate_file(args, args.dataset, device, named)
    return 0


def evaluate_file(args: argparse.Namespace, dataset: str, device, named: list) -> None:
    """Evaluate the model of ``args`` on the extxyz file ``dataset`` with the label
    options of ``args`` (those unset as the model was trained) and print the
    errors; ``named``: the label keys the file must have."""
    dtype = {"float32": torch.float32, "float64": torch.float64, None: None}[args.dtype]
    label_options(args)
    metrics, _ = evaluate(
        args.model,
        dataset,
        batch_size=args.batch_size,
        dtype=dtype,
        device=device,
        which=args.which,
        energy_key=args.energy_key,
        forces_key=args.forces_key,
        stress_key=args.stress_key,
        virial_key=args.virial_key,
        energy_unit=args.energy_unit,
        length_unit=args.length_unit,
        charge_key=args.charge_key,
        spin_multiplicity_key=args.spin_key,
        output=args.output,
        target=args.target,
        required_keys=named,
    )
    log.info(f"{dataset}: {metrics['n_structures']} structures, {metrics['n_atoms']} atoms")
    rows = (
        ("energy_per_atom", "energy/atom", "eV/atom"),
        ("forces", "forces", "eV/Å"),
        ("stress", "stress", "eV/Å^3"),
    )
    if any(f"{key}_rmse" in metrics for key, _, _ in rows):
        log.info(f"{'':16s}{'RMSE':>12s}{'MAE':>12s}  unit      labels")
    else:
        log.info("no labels in the file: predictions only")
    for key, name, unit in rows:
        if f"{key}_rmse" in metrics:
            log.info(
                f"{name:16s}{metrics[f'{key}_rmse']:12.5g}{metrics[f'{key}_mae']:12.5g}  "
                f"{unit:8s}  {metrics[f'{key}_count']}"
            )
        if metrics.get(f"{key}_nan_predictions"):
            log.warning(f"warning: {metrics[f'{key}_nan_predictions']} {name} predictions are NaN")
    if args.json:
        Path(args.json).write_text(json.dumps(metrics, indent=2))
    if args.output:
        log.info(f"predictions written to {args.output}")
