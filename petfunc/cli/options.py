"""The options of a ``petfunc train`` command: read from its options file (or a
restart's checkpoint, or the demo's), with its flags and ``--set`` items applied.
``docs/options.md`` lists every option and flag."""

from __future__ import annotations

import copy
import json
import re
import sys
from pathlib import Path

import yaml

from petfunc.cli.demo import DEMO_OPTIONS, DEMO_STRUCTURES
from petfunc.cli.outputs import newest_checkpoint
from petfunc.io import read_checkpoint
from petfunc.trainer.options import set_option


def yaml_load(stream):
    """``yaml.safe_load`` that reads ``1e-3`` as a number, as metatrain's OmegaConf
    (and YAML 1.2) does; PyYAML's YAML 1.1 rules need a dot (``1.0e-3``) and would
    give the string ``'1e-3'``."""

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
        list("-+0123456789."),
    )
    return yaml.load(stream, Loader=Loader)


def read_options_file(path) -> dict:
    """The options mapping of the YAML file ``path`` (numbers as :func:`yaml_load`
    reads them); errors name the file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"options file not found: {str(path)!r}")
    try:
        with open(path, encoding="utf-8") as handle:
            data = yaml_load(handle)
    except yaml.YAMLError as error:
        raise ValueError(f"could not parse options file {str(path)!r}: {error}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ValueError(f"options file {str(path)!r} must hold a mapping, got {type(data).__name__}")
    return data


def overrides(args) -> list[tuple]:
    """``(dotted option, value)`` of the ``petfunc train`` flags given in ``args``, then
    of its ``--set KEY=VALUE`` items (``VALUE`` read as YAML), in that order."""
    t = "architecture.training"
    pairs = []
    for name, key, convert in (
        ("epochs", f"{t}.num_epochs", None),
        ("batch_size", f"{t}.batch_size", None),
        ("lr", f"{t}.learning_rate", None),
        ("seed", "seed", None),
        ("dtype", "base_precision", lambda v: 64 if v == "float64" else 32),
        ("device", "device", None),
        ("compile", f"{t}.compile", None),
        ("backend", f"{t}.compile_backend", None),
        ("remat", f"{t}.remat", None),
        ("augmentation", f"{t}.augmentation", None),
        ("deterministic", f"{t}.deterministic", None),
        ("finetune", f"{t}.finetune.read_from", None),
        ("finetune_method", f"{t}.finetune.method", None),
    ):
        value = getattr(args, name)
        if value is not None:
            pairs.append((key, convert(value) if convert else value))
    for item in args.set:
        if "=" not in item:
            raise ValueError(f"--set/--override expects KEY=VALUE, got {item!r}")
        key, text = item.split("=", 1)
        try:
            value = yaml_load(text)
        except yaml.YAMLError:
            value = text
        pairs.append((key.strip(), value))
    return pairs


def options_of(args) -> tuple[dict, bool]:
    """``(options, demo)`` of a ``petfunc train`` command: its options file's, else
    the ``--restart`` checkpoint's, else the demo's (``demo``: the built-in dataset is
    to be written), with the flags applied. A restart with an options file that
    names no datasets takes the checkpoint's. ``--restart auto`` becomes the newest
    checkpoint under ``outputs/`` (:func:`petfunc.cli.outputs.newest_checkpoint`)."""
    if args.restart == "auto":
        args.restart = str(newest_checkpoint())
        print(f"--restart auto: continuing {args.restart}")
    restart = args.restart
    if restart is not None:
        ckpt = read_checkpoint(restart)
        stored = json.loads(ckpt["options"])
    if args.options:
        options = read_options_file(args.options)
        demo = False
    elif restart is not None:
        options = stored
        demo = False
    else:
        options = copy.deepcopy(DEMO_OPTIONS)
        demo = True
        if args.finetune:
            # the architecture is the fine-tuned model's: the demo's would be compared
            # with it (and refused) although the user never asked for it
            options["architecture"]["model"] = {}
    if restart is not None and args.options and "training_set" not in options:
        options["training_set"] = stored["training_set"]
        options.setdefault("validation_set", stored["validation_set"])
        if "test_set" in stored:
            options.setdefault("test_set", stored["test_set"])
    for key, value in overrides(args):
        set_option(options, key, value)
    if demo and options.get("training_set") is not None:
        demo = False  # --set training_set=...: the demo's defaults on the user's data
    if not demo and args.structures != DEMO_STRUCTURES:
        print(
            f"petfunc: warning: --structures {args.structures} is not used: it sizes the built-in demo "
            "dataset, and this run reads its own",
            file=sys.stderr,
        )
    return options, demo
