"""The options of ``petfunc train``: metatrain's ``options.yaml`` layout, checked and
completed with defaults.

``docs/options.md`` documents every key; ``examples/options.yaml`` is a complete
example. :func:`resolve_options` turns a user mapping into the full options (every
default filled in, shorthands expanded) and raises ``ValueError`` naming the
offending key for anything it does not know.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from petfunc.config import PETConfig
from petfunc.devices import MULTI_GPU, resolve_device
from petfunc.trainer.options.baselines import resolve_baselines
from petfunc.trainer.options.checks import check_keys, merge, number
from petfunc.trainer.options.datasets import energy_target_name, held_out, indices_only, resolve_datasets
from petfunc.trainer.options.finetune import resolve_finetune
from petfunc.trainer.options.loss import resolve_loss


#: ``architecture.training`` defaults: metatrain's PET trainer (v2026.4) plus
#: petfunc's own keys (``augmentation``, ``compile``, ``compile_backend``, ``remat``,
#: ``deterministic``).
TRAINING_DEFAULTS: dict[str, Any] = {
    "batch_size": 16,
    # metatrain's packing by atom count (batch_size then only sets the composition
    # fit's accumulation); batches under min_atoms_per_batch atoms are skipped
    "max_atoms_per_batch": None,
    "min_atoms_per_batch": 0,
    # metatrain's targets whose loss (and scale) compare whole structures, not per
    # atom: [] or [energy]
    "per_structure_targets": [],
    "num_epochs": 1000,
    "warmup_fraction": 0.01,
    "learning_rate": 1e-4,
    "weight_decay": None,
    "grad_clip_norm": 1.0,
    "loss": "mse",
    "best_model_metric": "mae_prod",
    "log_interval": 1,
    "checkpoint_interval": 100,
    "scale_targets": True,
    # metatrain's fixed composition: {} (fit), {energy: w} (every type) or
    # {energy: {Z: w, ...}} (every type of the model listed)
    "atomic_baseline": {},
    # metatrain's fixed scale: {} (fit) or {energy: c}; unused without scale_targets
    "fixed_scaling_weights": {},
    "finetune": {"read_from": None, "method": "full", "config": {}, "inherit_heads": {}},
    "augmentation": True,
    "compile": False,
    "compile_backend": "inductor",
    # recompute the transformer layers in the backward pass (petfunc.remat): less
    # memory for energy-only losses, more time; eager steps only
    "remat": False,
    # torch.use_deterministic_algorithms for the run (same seed, same result):
    # true, false, or null = on CPU only
    "deterministic": None,
    # metatrain's deprecated switch: null or false, or true in a run of several
    # processes (petfunc.trainer.fit checks that; torchrun makes the processes)
    "distributed": None,
}

#: metatrain trainer keys that only affect metatrain's logging or data loading:
#: accepted and left out of the resolved options (``distributed_port`` is the
#: rendezvous port of processes SLURM starts, which ``petfunc train`` reads itself).
IGNORED_METATRAIN_KEYS = ("num_workers", "log_mae", "log_separate_blocks", "distributed_port")

#: metatrain top-level keys about its own logging: accepted and left out of the
#: resolved options (``wandb``: ``petfunc train`` logs to Weights & Biases itself).
IGNORED_METATRAIN_TOP_LEVEL_KEYS = ("print_stats", "final_eval", "wandb")

#: the metatrain options petfunc accepts and does not use, each with why: a run
#: that gives one is warned once, naming it
UNUSED_METATRAIN_OPTIONS = {
    "architecture.training.num_workers": "petfunc builds its batches in the training process, "
    "with no data-loader workers",
    "architecture.training.log_mae": "petfunc logs the MAE and the RMSE of every label always",
    "architecture.training.log_separate_blocks": "petfunc's energy target has one block",
    "print_stats": "petfunc prints no dataset statistics",
    "final_eval": "petfunc evaluates the best model on the validation and test sets at the end of every run",
}


def warn_unused(given: Mapping, prefix: str) -> None:
    """One warning for each key of ``given`` (the section ``prefix``) that petfunc
    accepts from metatrain and does not use (:data:`UNUSED_METATRAIN_OPTIONS`)."""
    for key in given:
        name = f"{prefix}{key}"
        if name in UNUSED_METATRAIN_OPTIONS:
            warnings.warn(
                f"option '{name}' is metatrain's and not used by petfunc ({UNUSED_METATRAIN_OPTIONS[name]}); "
                "ignored",
                stacklevel=3,
            )


TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "base_precision": 32,
    # metatrain's default: the best device of this machine (CUDA when visible)
    "device": "auto",
    "architecture": {"name": "pet"},
    "training_set": None,
    "validation_set": 0.1,
    "test_set": None,
}

MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(PETConfig))  # keys of architecture.model


def resolve_options(given: Mapping | None = None, base: Mapping | None = None) -> dict:
    """Complete and check an options mapping (metatrain's ``options.yaml`` layout).

    Args:
        given: the user's options.
        base: defaults to apply before ``given`` (e.g. the built-in demo run's);
            metatrain's defaults apply under both.

    Returns:
        the full options: every default filled in, datasets expanded by
        :func:`petfunc.trainer.options.resolve_dataset`.

    Raises:
        ValueError: an unknown key (named, with a suggestion), a value of the wrong
            type or range, or a metatrain option that petfunc does not implement.
    """
    given = dict(given or {})
    check_keys(given, tuple(TOP_LEVEL_DEFAULTS) + IGNORED_METATRAIN_TOP_LEVEL_KEYS, "")
    warn_unused(given, "")
    if given.get("wandb"):
        warnings.warn(
            "option 'wandb': petfunc.trainer.fit does not log to Weights & Biases (petfunc train "
            "does, with wandb installed); ignored (the metrics are in the run's metrics.csv)",
            stacklevel=2,
        )
    for key in IGNORED_METATRAIN_TOP_LEVEL_KEYS:
        given.pop(key, None)
    merged = merge(TOP_LEVEL_DEFAULTS, base or {})
    merged = merge(merged, given)

    arch = merged["architecture"]
    check_keys(arch, ("name", "model", "training", "atomic_types"), "architecture")
    if arch.get("name") != "pet":
        raise ValueError(f"option 'architecture.name' must be 'pet', got {arch.get('name')!r}")
    arch["model"] = _model(arch)
    arch["training"] = _training(arch.get("training") or {}, energy_target_name(merged.get("training_set")))
    _top_level(merged)
    return merged


def _model(arch: dict) -> dict:
    """The ``architecture.model`` section, with ``architecture.atomic_types`` moved in."""
    model = dict(arch.get("model") or {})
    check_keys(model, MODEL_FIELDS, "architecture.model")
    if "atomic_types" in arch:
        model["atomic_types"] = list(arch.pop("atomic_types"))
    # check the values now (atomic types come from the data later). A fine-tuning or
    # restart run takes the keys it omits from its checkpoint, not the defaults:
    # {d_pet: 16} is valid there with a checkpoint of num_heads 4, though not with the
    # default 8. So only relations between given keys are checked here; the full
    # architecture where it is made (trainer.check_model_section, or a fresh model).
    try:
        PETConfig.check_partial(model)
    except (ValueError, TypeError, NotImplementedError) as error:
        raise ValueError(f"option 'architecture.model': {error}") from None
    return model


def _training(given: Mapping, target: str) -> dict:
    """The ``architecture.training`` section: defaults filled in, values checked;
    ``target`` is the name of the trained energy target."""
    training = dict(given)
    allowed = tuple(TRAINING_DEFAULTS) + IGNORED_METATRAIN_KEYS
    check_keys(training, allowed, "architecture.training")
    warn_unused(training, "architecture.training.")
    for key in IGNORED_METATRAIN_KEYS:
        training.pop(key, None)
    training = merge(TRAINING_DEFAULTS, training)
    t = "architecture.training"
    resolve_baselines(training)
    if training["distributed"] not in (None, False, True):
        raise ValueError(f"option '{t}.distributed' must be true or false, got {training['distributed']!r}")
    _batches(training)
    _schedule(training)
    _switches(training)
    resolve_finetune(training["finetune"], target)
    training["loss"] = resolve_loss(training["loss"], target)
    return training


def _batches(training: dict) -> None:
    """Check ``batch_size``, ``max/min_atoms_per_batch`` and ``per_structure_targets``."""
    t = "architecture.training"
    training["batch_size"] = number(training["batch_size"], f"{t}.batch_size", positive=True, integer=True)
    if training["max_atoms_per_batch"] is not None:
        training["max_atoms_per_batch"] = number(
            training["max_atoms_per_batch"], f"{t}.max_atoms_per_batch", positive=True, integer=True
        )
    training["min_atoms_per_batch"] = number(
        training["min_atoms_per_batch"], f"{t}.min_atoms_per_batch", minimum=0, integer=True
    )
    per_structure = training["per_structure_targets"]
    if per_structure is None:
        per_structure = []
    if not isinstance(per_structure, (list, tuple)) or any(not isinstance(n, str) for n in per_structure):
        raise ValueError(
            f"option '{t}.per_structure_targets' must be a list of target names, got {per_structure!r}"
        )
    unknown = sorted(set(per_structure) - {"energy"})
    if unknown:
        raise ValueError(
            f"option '{t}.per_structure_targets': unknown target(s) {unknown}; the only target is 'energy'"
        )
    training["per_structure_targets"] = sorted(set(per_structure))
    if training["max_atoms_per_batch"] is None and training["min_atoms_per_batch"]:
        raise ValueError(f"option '{t}.min_atoms_per_batch' needs '{t}.max_atoms_per_batch'")
    if (
        training["max_atoms_per_batch"] is not None
        and training["min_atoms_per_batch"] > training["max_atoms_per_batch"]
    ):
        raise ValueError(
            f"option '{t}.min_atoms_per_batch' ({training['min_atoms_per_batch']}) exceeds "
            f"'max_atoms_per_batch' ({training['max_atoms_per_batch']})"
        )


def _schedule(training: dict) -> None:
    """Check the epochs, the learning rate and its schedule, clipping and the intervals."""
    t = "architecture.training"
    training["num_epochs"] = number(training["num_epochs"], f"{t}.num_epochs", minimum=0, integer=True)
    training["warmup_fraction"] = number(
        training["warmup_fraction"], f"{t}.warmup_fraction", minimum=0.0, maximum=1.0
    )
    training["learning_rate"] = number(training["learning_rate"], f"{t}.learning_rate", minimum=0.0)
    if training["weight_decay"] is not None:
        training["weight_decay"] = number(training["weight_decay"], f"{t}.weight_decay", minimum=0.0)
    if training["grad_clip_norm"] is not None:
        training["grad_clip_norm"] = number(training["grad_clip_norm"], f"{t}.grad_clip_norm", positive=True)
    training["log_interval"] = number(
        training["log_interval"], f"{t}.log_interval", positive=True, integer=True
    )
    training["checkpoint_interval"] = number(
        training["checkpoint_interval"], f"{t}.checkpoint_interval", positive=True, integer=True
    )
    if training["best_model_metric"] not in ("mae_prod", "rmse_prod", "loss"):
        raise ValueError(
            f"option '{t}.best_model_metric' must be 'mae_prod', 'rmse_prod' or 'loss', "
            f"got {training['best_model_metric']!r}"
        )


def _switches(training: dict) -> None:
    """Check the true/false options, ``deterministic``, ``remat`` and ``compile``."""
    t = "architecture.training"
    for key in ("augmentation", "compile", "scale_targets", "remat"):
        if not isinstance(training[key], bool):
            raise ValueError(f"option '{t}.{key}' must be true or false, got {training[key]!r}")
    if training["deterministic"] is not None and not isinstance(training["deterministic"], bool):
        raise ValueError(
            f"option '{t}.deterministic' must be true, false or null, got {training['deterministic']!r}"
        )
    if training["remat"] and training["compile"]:
        raise ValueError(
            f"options '{t}.remat' and '{t}.compile' exclude each other: rematerialisation "
            "runs with torch.autograd in eager steps (torch.func and compiled steps do not support it)"
        )
    if training["compile_backend"] not in ("inductor", "aot_eager", "eager"):
        raise ValueError(
            f"option '{t}.compile_backend' must be 'inductor', 'aot_eager' or 'eager', "
            f"got {training['compile_backend']!r}"
        )


def _top_level(merged: dict) -> None:
    """Check ``seed``, ``base_precision``, ``device`` and the datasets of ``merged``."""
    merged["seed"] = number(merged["seed"], "seed", minimum=0, integer=True)
    if merged["base_precision"] not in (32, 64):
        raise ValueError(f"option 'base_precision' must be 32 or 64, got {merged['base_precision']!r}")
    device = str(merged["device"]).lower()
    if device in MULTI_GPU:
        resolve_device(device, "option 'device'")  # raises: how to train on several GPUs
    if not (device in ("auto", "cpu", "gpu") or device.startswith("cuda")):
        raise ValueError(
            f"option 'device' must be 'auto', 'cpu', 'cuda' (or 'gpu') or 'cuda:N', got {merged['device']!r}"
        )
    merged["device"] = device
    if merged["training_set"] is None:
        raise ValueError("option 'training_set' is required (an extxyz file or a dataset section)")
    merged["training_set"] = resolve_datasets(merged["training_set"], "training_set")
    if merged["test_set"] is None:
        merged["test_set"] = 0.0
    for name in ("validation_set", "test_set"):
        merged[name] = held_out(merged[name], name, merged["training_set"])
    both = [merged[n] for n in ("validation_set", "test_set")]
    if all(indices_only(x) for x in both) and set(both[0]["indices"]) & set(both[1]["indices"]):
        raise ValueError(
            "options 'validation_set.indices' and 'test_set.indices' share structures "
            f"{sorted(set(both[0]['indices']) & set(both[1]['indices']))[:10]}"
        )
    fractions = [merged[n] for n in ("validation_set", "test_set") if isinstance(merged[n], float)]
    if not sum(fractions) < 1.0:
        raise ValueError(
            f"options 'validation_set' and 'test_set' take all of the data ({sum(fractions):g}); "
            "their fractions must add up to less than 1"
        )


def set_option(options: dict, dotted: str, value) -> None:
    """Set ``options["a"]["b"]["c"] = value`` for ``dotted = "a.b.c"`` (creating sections)."""
    node = options
    *parents, leaf = dotted.split(".")
    for part in parents:
        child = node.get(part)
        if child is None or not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[leaf] = value


def absolute_paths(options: dict) -> dict:
    """Make the file paths of resolved ``options`` absolute (in place; returned): the
    datasets' files, ``finetune.read_from`` and metatrain baseline checkpoints, so
    that the options written to a run's folder work from any folder."""
    for name in ("training_set", "validation_set", "test_set"):
        value = options.get(name)
        for section in value if isinstance(value, list) else [value]:
            if isinstance(section, dict) and "systems" in section:  # (not metatrain's indices-only form)
                section["systems"]["read_from"] = str(
                    Path(section["systems"]["read_from"]).expanduser().resolve()
                )
    training = options["architecture"]["training"]
    finetune = training["finetune"]
    if finetune.get("read_from"):
        finetune["read_from"] = str(Path(finetune["read_from"]).expanduser().resolve())
    for key in ("atomic_baseline", "fixed_scaling_weights"):  # metatrain checkpoints
        if "file" in training[key]:
            training[key]["file"] = str(Path(training[key]["file"]).expanduser().resolve())
    return options
