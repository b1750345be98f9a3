"""Options of ``petfunc train``: metatrain's ``options.yaml`` layout, checked and
completed with defaults.

The schema is documented in :mod:`petfunc.cli`; ``examples/options.yaml`` is a
complete example. :func:`resolve_options` turns a user mapping into the full
options (every default filled in, shorthands expanded) and raises ``ValueError``
naming the offending key for anything it does not know.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import json
import os
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from petfunc.config import PETConfig
from petfunc.train import LossTerm, LossWeights
from petfunc.units import energy_unit_factor, length_unit_factor


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
    # processes (petfunc.trainer.training checks that; torchrun makes the processes)
    "distributed": None,
}

#: metatrain trainer keys that only affect metatrain's logging or data loading:
#: accepted and ignored.
IGNORED_METATRAIN_KEYS = ("num_workers", "log_mae", "log_separate_blocks", "distributed_port")

#: metatrain top-level keys about its own logging: accepted and ignored (``wandb``
#: with a warning, as petfunc has no Weights & Biases logger).
IGNORED_METATRAIN_TOP_LEVEL_KEYS = ("print_stats", "final_eval", "wandb")

TOP_LEVEL_DEFAULTS: dict[str, Any] = {
    "seed": 0,
    "base_precision": 32,
    "device": "cpu",
    "architecture": {"name": "pet"},
    "training_set": None,
    "validation_set": 0.1,
    "test_set": None,
}

# ---------------------------------------------------------------------------------------
# helpers


def _check_keys(section: Mapping, allowed, where: str) -> None:
    """Raise ``ValueError`` naming the first key of ``section`` not in ``allowed``."""
    if not isinstance(section, Mapping):
        raise ValueError(f"option '{where}' must be a mapping, got {section!r}")
    for key in section:
        if key not in allowed:
            name = f"{where}.{key}" if where else str(key)
            close = difflib.get_close_matches(str(key), [str(a) for a in allowed], n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise ValueError(f"unknown option '{name}'{hint}; valid keys here: {sorted(map(str, allowed))}")


def _merge(defaults: Mapping, given: Mapping) -> dict:
    out = copy.deepcopy(dict(defaults))
    for key, value in given.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping):
            out[key] = _merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def _module_names(value, name: str) -> None:
    """Raise ``ValueError`` unless ``value`` is a list of module names (strings)."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"option '{name}' must be a list of module names, got {value!r}")


def _number(value, name: str, positive=False, integer=False, minimum=None, maximum=None):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"option '{name}' must be a number, got {value!r}")
    if integer and int(value) != value:
        raise ValueError(f"option '{name}' must be an integer, got {value!r}")
    if positive and not value > 0:
        raise ValueError(f"option '{name}' must be positive, got {value!r}")
    if minimum is not None and value < minimum:
        raise ValueError(f"option '{name}' must be >= {minimum}, got {value!r}")
    if maximum is not None and value > maximum:
        raise ValueError(f"option '{name}' must be <= {maximum}, got {value!r}")
    return int(value) if integer else float(value)


# ---------------------------------------------------------------------------------------
# datasets


_GRADIENTS = ("forces", "stress", "virial")


def _gradient(value, default_key: str, where: str):
    """``False``, ``"auto"`` or ``{"key": ...}`` for a forces/stress/virial entry."""
    if value is None or value is False:
        return False
    if value == "auto":
        return "auto"
    if value is True:
        return {"key": default_key}
    if isinstance(value, str):  # metatrain: a path to read from
        return {"key": default_key, "read_from": value}
    if isinstance(value, Mapping):
        _check_keys(value, ("key", "read_from", "reader"), where)
        out = {"key": value.get("key", default_key)}
        if value.get("read_from") is not None:
            out["read_from"] = value["read_from"]
        if value.get("reader") not in (None, "ase"):
            raise ValueError(f"option '{where}.reader': only the 'ase' reader is supported")
        return out
    raise ValueError(f"option '{where}' must be true, false, 'auto' or a mapping, got {value!r}")


def resolve_dataset(section, where: str) -> dict:
    """Expand a dataset section (metatrain's shorthand included) to its full form::

        {"systems": {"read_from", "length_unit"},
         "targets": {"energy": {"key", "unit", "forces", "stress", "virial"}}}

    ``forces``/``stress`` default to ``"auto"`` (use the key ``forces``/``stress``
    when the file has it); an explicit entry makes the labels required.
    ``extra_data`` (metatrain's section) may name the ``atoms.info`` keys of the
    total ``charge`` and the ``spin_multiplicity`` that a model with
    ``system_conditioning`` reads; it resolves to ``{"charge": key or None,
    "spin_multiplicity": key or None}`` (``None``: the default keys).
    """
    if isinstance(section, (str, Path)):
        section = {"systems": str(section)}
    if not isinstance(section, Mapping):
        raise ValueError(f"option '{where}' must be a file name or a mapping, got {section!r}")
    _check_keys(section, ("systems", "targets", "extra_data", "indices"), where)
    systems = section.get("systems")
    if isinstance(systems, (str, Path)):
        systems = {"read_from": str(systems)}
    if not isinstance(systems, Mapping) or systems.get("read_from") is None:
        raise ValueError(f"option '{where}.systems' must name a file (systems: {{read_from: FILE}})")
    _check_keys(systems, ("read_from", "reader", "length_unit"), f"{where}.systems")
    if systems.get("reader") not in (None, "ase"):
        raise ValueError(f"option '{where}.systems.reader': only the 'ase' reader is supported")
    length_unit = systems.get("length_unit") or "angstrom"
    length_unit_factor(length_unit)
    read_from = str(systems["read_from"])

    targets = section.get("targets")
    if targets is None:
        targets = {"energy": {}}
    if not isinstance(targets, Mapping):
        raise ValueError(f"option '{where}.targets' must be a mapping")
    # one energy target; metatrain names others "mtt::NAME" (key: the name by default)
    name = "energy"
    if len(targets) == 1 and "energy" not in targets:
        (name,) = targets
    _check_keys(targets, (name,), f"{where}.targets")
    energy = targets.get(name, {})
    if energy is None:
        energy = {}
    if isinstance(energy, str):
        energy = {"read_from": energy}
    where_e = f"{where}.targets.{name}"
    _check_keys(
        energy,
        (
            "key",
            "unit",
            "read_from",
            "reader",
            "quantity",
            "forces",
            "stress",
            "virial",
            "description",
            "per_atom",
            "type",
            "num_subtargets",
        ),
        where_e,
    )
    for key, default in (
        ("quantity", "energy"),
        ("per_atom", False),
        ("type", "scalar"),
        ("num_subtargets", 1),
    ):
        if key in energy and energy[key] != default:
            raise ValueError(f"option '{where_e}.{key}' must be {default!r} (petfunc trains total energies)")
    if energy.get("read_from") not in (None, read_from):
        raise ValueError(
            f"option '{where_e}.read_from': labels must come from the systems file {read_from!r}"
        )
    if energy.get("reader") not in (None, "ase"):
        raise ValueError(f"option '{where_e}.reader': only the 'ase' reader is supported")
    unit = energy.get("unit") or "eV"
    energy_unit_factor(unit)
    gradient_default = "auto" if name == "energy" or energy.get("quantity") == "energy" else False
    resolved = {
        "key": energy.get("key") or name,
        "unit": unit,
        # metatrain reads forces and stress by default for a target named 'energy' or
        # with an explicit 'quantity: energy' only (mtt::E: {key: E} has none)
        "forces": _gradient(energy.get("forces", gradient_default), "forces", f"{where_e}.forces"),
        "stress": _gradient(energy.get("stress", gradient_default), "stress", f"{where_e}.stress"),
        "virial": _gradient(energy.get("virial", False), "virial", f"{where_e}.virial"),
    }
    for name in _GRADIENTS:
        value = resolved[name]
        if isinstance(value, dict) and value.pop("read_from", read_from) != read_from:
            raise ValueError(
                f"option '{where_e}.{name}.read_from': labels must come from the systems file {read_from!r}"
            )
    if resolved["virial"] and resolved["stress"] and resolved["stress"] != "auto":
        raise ValueError(f"option '{where_e}': cannot use stress and virial at the same time")
    if resolved["virial"]:
        resolved["stress"] = False
    if "description" in energy:
        resolved["description"] = energy["description"]
    out = {
        "systems": {"read_from": read_from, "length_unit": length_unit},
        "targets": {"energy": resolved},
        "extra_data": _extra_data(section.get("extra_data") or {}, f"{where}.extra_data", read_from),
    }
    if section.get("indices") is not None:
        out["indices"] = load_indices(section["indices"], f"{where}.indices")
    return out


def load_indices(value, where: str) -> list:
    """metatrain's ``indices``: a list of structure indices (0-based, in the file), or
    the name of a text file with one index per line (relative to the working folder)."""
    if isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise ValueError(f"option '{where}': no indices file at {str(path)!r}")
        try:
            value = np.loadtxt(path, dtype=np.int64, ndmin=1).tolist()
        except ValueError as error:
            raise ValueError(
                f"option '{where}': {str(path)!r} is not a file of integers, one per line ({error})"
            ) from None
    if not isinstance(value, (list, tuple)) or any(
        isinstance(i, bool) or not isinstance(i, (int, np.integer)) for i in value
    ):
        raise ValueError(
            f"option '{where}' must be a list of structure indices or the name of a file of them, "
            f"got {value!r}"
        )
    value = [int(i) for i in value]
    if any(i < 0 for i in value):
        raise ValueError(f"option '{where}': indices must be non-negative, got {min(value)}")
    if len(set(value)) != len(value):
        raise ValueError(f"option '{where}': indices must not repeat")
    return value


def _extra_data(section, where: str, read_from: str) -> dict:
    """``{"charge": key | None, "spin_multiplicity": key | None}`` from metatrain's
    ``extra_data: {charge: {key: K}, spin_multiplicity: {key: K}}`` (or ``charge: K``;
    ``None`` keeps the default keys, so a resolved section resolves to itself)."""
    _check_keys(section, ("charge", "spin_multiplicity"), where)
    out = {"charge": None, "spin_multiplicity": None}
    for name, entry in section.items():
        if entry is None:  # resolved form: the default keys
            continue
        if isinstance(entry, str):
            entry = {"key": entry}
        _check_keys(
            entry,
            (
                "key",
                "read_from",
                "reader",
                "quantity",
                "unit",
                "type",
                "per_atom",
                "num_subtargets",
                "description",
            ),
            f"{where}.{name}",
        )
        if entry.get("per_atom"):
            raise ValueError(f"option '{where}.{name}.per_atom': the {name} is one number per structure")
        if entry.get("reader") not in (None, "ase"):
            raise ValueError(f"option '{where}.{name}.reader': only the 'ase' reader is supported")
        if entry.get("read_from") not in (None, read_from):
            raise ValueError(
                f"option '{where}.{name}.read_from': it must come from the systems file {read_from!r}"
            )
        out[name] = str(entry.get("key") or name)
    return out


# ---------------------------------------------------------------------------------------
# fixed composition


def _checkpoint_file(value) -> dict | None:
    """``{"file": path}`` if ``value`` names a metatrain checkpoint (a path, or that
    form already resolved, as a restart reads it back), else ``None``."""
    if isinstance(value, (str, os.PathLike)):
        return {"file": os.fspath(value)}
    if isinstance(value, Mapping) and set(value) == {"file"}:
        return {"file": os.fspath(value["file"])}
    return None


def _atomic_baseline(value, where: str) -> dict:
    """``{}``, ``{"energy": float | {Z: float}}`` (metatrain's forms, energy only), or
    ``{"file": path}`` for a metatrain composition model checkpoint."""
    if (checkpoint := _checkpoint_file(value)) is not None:
        return checkpoint
    if not isinstance(value, Mapping):
        raise ValueError(
            f"option '{where}' must be a mapping like {{energy: {{1: -13.6, 8: -2041.3}}}} "
            f"or the path of a metatrain composition model checkpoint, got {value!r}"
        )
    _check_keys(value, ("energy",), where)
    if "energy" not in value:
        return {}
    energy = value["energy"]
    if isinstance(energy, Mapping):
        out = {}
        for z, w in energy.items():
            if isinstance(z, bool) or not isinstance(z, (int, str)) or not str(z).lstrip("-").isdigit():
                raise ValueError(f"option '{where}.energy': keys must be atomic numbers, got {z!r}")
            out[int(z)] = _number(w, f"{where}.energy.{z}")
        return {"energy": out}
    return {"energy": _number(energy, f"{where}.energy")}


def _fixed_scaling_weights(value, where: str) -> dict:
    """``{}``, ``{"energy": c}`` with c > 0 (metatrain's form for a per-structure
    target), or ``{"file": path}`` for a metatrain scaler checkpoint."""
    if (checkpoint := _checkpoint_file(value)) is not None:
        return checkpoint
    if not isinstance(value, Mapping):
        raise ValueError(
            f"option '{where}' must be a mapping like {{energy: 0.5}} or the path of a "
            f"metatrain scaler checkpoint, got {value!r}"
        )
    _check_keys(value, ("energy",), where)
    if "energy" not in value:
        return {}
    if isinstance(value["energy"], Mapping):
        raise ValueError(
            f"option '{where}.energy': a scale per atomic type is not supported for the "
            "per-structure energy target (as in metatrain); give one number"
        )
    return {"energy": _number(value["energy"], f"{where}.energy", positive=True)}


def fixed_composition(baseline: Mapping, atomic_types) -> np.ndarray | None:
    """Per-species energies from a resolved ``atomic_baseline`` (None: fit them).
    A mapping must list every atomic type of the model, as metatrain requires."""
    if "energy" not in baseline:
        return None
    energy = baseline["energy"]
    if not isinstance(energy, Mapping):
        return np.full(len(atomic_types), float(energy))
    missing = sorted(set(int(z) for z in atomic_types) - set(energy))
    if missing:
        raise ValueError(
            f"option 'architecture.training.atomic_baseline.energy' has no weight for atomic "
            f"type(s) {missing}; it must list every type of the model ({list(atomic_types)})"
        )
    return np.array([float(energy[int(z)]) for z in atomic_types])


# ---------------------------------------------------------------------------------------
# loss


_TERM_ALIASES = {
    "positions": "forces",
    "forces": "forces",
    "strain": "stress",
    "stress": "stress",
    "virial": "stress",
}


def _loss_term(spec, where: str, default_type: str) -> LossTerm:
    if isinstance(spec, str):
        return LossTerm(1.0, spec)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return LossTerm(float(spec), default_type)
    if not isinstance(spec, Mapping):
        raise ValueError(f"option '{where}' must be a loss type, a weight or a mapping, got {spec!r}")
    _check_keys(spec, ("type", "weight", "reduction", "delta"), where)
    if "delta" in spec and spec.get("type", default_type) != "huber":
        # metatrain's mse and mae losses take no delta (they fail on it)
        raise ValueError(
            f"option '{where}.delta' is the threshold of the 'huber' loss; this term is "
            f"{spec.get('type', default_type)!r}"
        )
    if spec.get("reduction", "mean") not in ("mean", "sum"):
        raise ValueError(f"option '{where}.reduction' must be 'mean' or 'sum', got {spec['reduction']!r}")
    try:
        return LossTerm(
            _number(spec.get("weight", 1.0), f"{where}.weight", minimum=0.0),
            spec.get("type", default_type),
            _number(spec.get("delta", 1.0), f"{where}.delta"),
            spec.get("reduction", "mean"),
        )
    except ValueError as error:
        raise ValueError(f"option '{where}': {error}") from None


def _energy_target_name(training_set) -> str:
    """The name of the energy target in a (raw) ``training_set`` option: ``energy``,
    or metatrain's ``mtt::NAME`` of a dataset whose one target is named so."""
    sections = training_set if isinstance(training_set, list) else [training_set]
    for section in sections:
        targets = section.get("targets") if isinstance(section, Mapping) else None
        if isinstance(targets, Mapping) and len(targets) == 1:
            return str(next(iter(targets)))
    return "energy"


def parse_loss(spec) -> tuple:
    """``(LossWeights, explicit)`` from the ``loss`` option.

    Accepted forms: a type (``"mse"``, ``"mae"``, ``"huber"``) for every term, or
    ``{energy: {type, weight, delta, gradients: {positions: {...}, strain: {...}}}}``
    (metatrain's layout; ``forces``/``stress``/``virial`` may also sit directly under
    ``energy``; :func:`resolve_options` renames the energy target's own name,
    ``mtt::NAME``, to ``energy``; a term may be a type, a weight or a mapping). As in
    metatrain's ``expand_loss_config``, only the global string form sets the type of every term:
    the energy term's type does not carry over to the force and stress terms, which
    are ``mse`` with weight 1 unless configured. ``delta`` is the Huber threshold
    (default 1). ``explicit`` is the set of gradient terms the user configured with a
    weight > 0, whose labels are then required.
    """
    where = "architecture.training.loss"
    if isinstance(spec, str):
        term = _loss_term(spec, where, "mse")
        return LossWeights(term, term, term), set()
    if not isinstance(spec, Mapping):
        raise ValueError(f"option '{where}' must be a loss type or a mapping, got {spec!r}")
    for key in spec:
        if key in _TERM_ALIASES:  # a natural guess; metatrain keeps them under the energy target
            raise ValueError(
                f"unknown option '{where}.{key}': the {_TERM_ALIASES[key]} loss is set under the energy target, "
                f"as '{where}.energy.gradients.{'positions' if _TERM_ALIASES[key] == 'forces' else 'strain'}' "
                f"(or '{where}.energy.{key if key in ('forces', 'stress', 'virial') else _TERM_ALIASES[key]}')"
            )
    _check_keys(spec, ("energy",), where)
    energy = spec.get("energy", {})
    if isinstance(energy, str):
        # as in metatrain, a target's type is not its gradients' type: those stay mse
        return LossWeights(_loss_term(energy, f"{where}.energy", "mse"), LossTerm(), LossTerm()), set()
    if not isinstance(energy, Mapping):
        raise ValueError(f"option '{where}.energy' must be a loss type or a mapping")
    where_e = f"{where}.energy"
    _check_keys(
        energy,
        (
            "type",
            "weight",
            "reduction",
            "delta",
            "gradients",
            "forces",
            "positions",
            "stress",
            "strain",
            "virial",
        ),
        where_e,
    )
    base = {k: v for k, v in energy.items() if k in ("type", "weight", "reduction", "delta")}
    energy_term = _loss_term(base, where_e, "mse")
    gradients = dict(energy.get("gradients") or {})
    if not isinstance(gradients, Mapping):
        raise ValueError(f"option '{where_e}.gradients' must be a mapping")
    for key in gradients:
        if key in ("forces", "stress", "virial"):
            # metatrain reads only these two names there, and ignores others silently
            raise ValueError(
                f"option '{where_e}.gradients.{key}': metatrain names gradients 'positions' (forces) and "
                f"'strain' (stress, virial); write '{where_e}.gradients.{'positions' if key == 'forces' else 'strain'}'"
                f" or the shorthand '{where_e}.{key}'"
            )
    _check_keys(gradients, ("positions", "strain"), f"{where_e}.gradients")
    entries = [(f"{where_e}.gradients.{k}", k, v) for k, v in gradients.items()]
    entries += [(f"{where_e}.{k}", k, energy[k]) for k in _TERM_ALIASES if k in energy]
    # metatrain (expand_loss_config): gradient terms default to mse with weight 1,
    # whatever the energy term's type; only a global loss type applies to all terms
    terms = {"forces": LossTerm(), "stress": LossTerm()}
    seen = {}
    explicit = set()
    for name, key, value in entries:
        target = _TERM_ALIASES[key]
        if target in seen:
            raise ValueError(f"options '{seen[target]}' and '{name}' both set the {target} loss")
        seen[target] = name
        terms[target] = _loss_term(value, name, "mse")
        if terms[target].weight > 0:
            explicit.add(target)
    return LossWeights(energy_term, terms["forces"], terms["stress"]), explicit


# ---------------------------------------------------------------------------------------
# everything


_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(PETConfig))


def resolve_options(given: Mapping | None = None, base: Mapping | None = None) -> dict:
    """Complete and check an options mapping (metatrain's ``options.yaml`` layout).

    Args:
        given: the user's options.
        base: defaults to apply before ``given`` (e.g. the built-in demo run's);
            metatrain's defaults apply under both.

    Returns:
        the full options: every default filled in, datasets expanded by
        :func:`resolve_dataset`.

    Raises:
        ValueError: an unknown key (named, with a suggestion), a value of the wrong
            type or range, or a metatrain option that petfunc does not implement.
    """
    given = dict(given or {})
    _check_keys(given, tuple(TOP_LEVEL_DEFAULTS) + IGNORED_METATRAIN_TOP_LEVEL_KEYS, "")
    if given.get("wandb"):
        warnings.warn(
            "option 'wandb': petfunc does not log to Weights & Biases; ignored "
            "(the metrics are in the run's metrics.csv)",
            stacklevel=2,
        )
    for key in IGNORED_METATRAIN_TOP_LEVEL_KEYS:
        given.pop(key, None)
    merged = _merge(TOP_LEVEL_DEFAULTS, base or {})
    merged = _merge(merged, given)

    arch = merged["architecture"]
    _check_keys(arch, ("name", "model", "training", "atomic_types"), "architecture")
    if arch.get("name") != "pet":
        raise ValueError(f"option 'architecture.name' must be 'pet', got {arch.get('name')!r}")
    model = dict(arch.get("model") or {})
    _check_keys(model, _MODEL_FIELDS, "architecture.model")
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
    arch["model"] = model

    training = dict(arch.get("training") or {})
    allowed = tuple(TRAINING_DEFAULTS) + IGNORED_METATRAIN_KEYS
    _check_keys(training, allowed, "architecture.training")
    for key in IGNORED_METATRAIN_KEYS:
        training.pop(key, None)
    training = _merge(TRAINING_DEFAULTS, training)
    t = "architecture.training"
    training["atomic_baseline"] = _atomic_baseline(training["atomic_baseline"], f"{t}.atomic_baseline")
    training["fixed_scaling_weights"] = _fixed_scaling_weights(
        training["fixed_scaling_weights"], f"{t}.fixed_scaling_weights"
    )
    if "file" in training["fixed_scaling_weights"] and "file" not in training["atomic_baseline"]:
        raise ValueError(
            f"option '{t}.fixed_scaling_weights' names a scaler checkpoint, which needs "
            f"'{t}.atomic_baseline' to name a composition checkpoint too (as in metatrain)"
        )
    if training["distributed"] not in (None, False, True):
        raise ValueError(f"option '{t}.distributed' must be true or false, got {training['distributed']!r}")
    training["batch_size"] = _number(training["batch_size"], f"{t}.batch_size", positive=True, integer=True)
    if training["max_atoms_per_batch"] is not None:
        training["max_atoms_per_batch"] = _number(
            training["max_atoms_per_batch"], f"{t}.max_atoms_per_batch", positive=True, integer=True
        )
    training["min_atoms_per_batch"] = _number(
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
    training["num_epochs"] = _number(training["num_epochs"], f"{t}.num_epochs", minimum=0, integer=True)
    training["warmup_fraction"] = _number(
        training["warmup_fraction"], f"{t}.warmup_fraction", minimum=0.0, maximum=1.0
    )
    training["learning_rate"] = _number(training["learning_rate"], f"{t}.learning_rate", minimum=0.0)
    if training["weight_decay"] is not None:
        training["weight_decay"] = _number(training["weight_decay"], f"{t}.weight_decay", minimum=0.0)
    if training["grad_clip_norm"] is not None:
        training["grad_clip_norm"] = _number(training["grad_clip_norm"], f"{t}.grad_clip_norm", positive=True)
    training["log_interval"] = _number(
        training["log_interval"], f"{t}.log_interval", positive=True, integer=True
    )
    training["checkpoint_interval"] = _number(
        training["checkpoint_interval"], f"{t}.checkpoint_interval", positive=True, integer=True
    )
    if training["best_model_metric"] not in ("mae_prod", "rmse_prod", "loss"):
        raise ValueError(
            f"option '{t}.best_model_metric' must be 'mae_prod', 'rmse_prod' or 'loss', got {training['best_model_metric']!r}"
        )
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
            f"option '{t}.compile_backend' must be 'inductor', 'aot_eager' or 'eager', got {training['compile_backend']!r}"
        )
    finetune = training["finetune"]
    _check_keys(finetune, ("read_from", "method", "config", "inherit_heads", "target_name"), f"{t}.finetune")
    finetune.setdefault("method", "full")
    if finetune["method"] not in ("full", "heads", "lora"):
        raise ValueError(
            f"option '{t}.finetune.method' must be 'full', 'heads' or 'lora', got {finetune['method']!r}"
        )
    inherit = finetune.get("inherit_heads") or {}
    if not isinstance(inherit, Mapping):
        raise ValueError(f"option '{t}.finetune.inherit_heads' must be a mapping {{energy: SOURCE_TARGET}}")
    target = _energy_target_name(merged.get("training_set"))
    if target != "energy" and target in inherit:  # metatrain keys it by the trained target's name
        inherit = {("energy" if k == target else k): v for k, v in inherit.items()}
    _check_keys(inherit, ("energy",), f"{t}.finetune.inherit_heads")
    if inherit and not isinstance(inherit["energy"], str):
        raise ValueError(
            f"option '{t}.finetune.inherit_heads.energy' must be the name of a target of the "
            f"checkpoint, got {inherit['energy']!r}"
        )
    if inherit and not finetune.get("read_from"):
        raise ValueError(f"option '{t}.finetune.inherit_heads' needs '{t}.finetune.read_from'")
    finetune["inherit_heads"] = dict(inherit)
    if finetune["method"] == "full" and finetune.get("config"):
        raise ValueError(f"option '{t}.finetune.config' is only used with methods 'heads' and 'lora'")
    if finetune["method"] != "full" and not finetune.get("read_from"):
        raise ValueError(
            f"option '{t}.finetune.method: {finetune['method']}' needs '{t}.finetune.read_from' "
            "(the model to fine-tune)"
        )
    if finetune["method"] == "lora":
        lora_config = finetune.get("config") or {}
        _check_keys(lora_config, ("rank", "alpha", "target_modules"), f"{t}.finetune.config")
        lora_config = dict(lora_config)
        if "rank" in lora_config:
            lora_config["rank"] = _number(
                lora_config["rank"], f"{t}.finetune.config.rank", positive=True, integer=True
            )
        if "alpha" in lora_config:
            lora_config["alpha"] = _number(lora_config["alpha"], f"{t}.finetune.config.alpha", positive=True)
        _module_names(lora_config.get("target_modules", []), f"{t}.finetune.config.target_modules")
        finetune["config"] = lora_config
    if finetune["method"] == "heads":
        heads_config = finetune.get("config") or {}
        _check_keys(heads_config, ("head_modules", "last_layer_modules"), f"{t}.finetune.config")
        heads_config = dict(heads_config)
        for key, value in heads_config.items():
            _module_names(value, f"{t}.finetune.config.{key}")
        finetune["config"] = heads_config
    if finetune.get("read_from") and target != "energy":
        # the name of the trained target decides, as in metatrain, whether the
        # checkpoint already has it (kept heads and weights) or it is new; the
        # resolved datasets call it 'energy', so it is kept here
        finetune["target_name"] = target
    if "target_name" in finetune and not isinstance(finetune["target_name"], str):
        raise ValueError(f"option '{t}.finetune.target_name' must be a target name")
    if target != "energy" and isinstance(training["loss"], Mapping) and target in training["loss"]:
        # metatrain keys a target's loss by the target's name
        if "energy" in training["loss"]:
            raise ValueError(
                f"options '{t}.loss.energy' and '{t}.loss.{target}' both set the loss of the "
                f"energy target {target!r}"
            )
        training["loss"] = {("energy" if k == target else k): v for k, v in training["loss"].items()}
    parse_loss(training["loss"])  # validate now
    arch["training"] = training

    merged["seed"] = _number(merged["seed"], "seed", minimum=0, integer=True)
    if merged["base_precision"] not in (32, 64):
        raise ValueError(f"option 'base_precision' must be 32 or 64, got {merged['base_precision']!r}")
    device = str(merged["device"])
    if not (device == "cpu" or device.startswith("cuda")):
        raise ValueError(f"option 'device' must be 'cpu' or 'cuda[:N]', got {device!r}")
    merged["device"] = device
    if merged["training_set"] is None:
        raise ValueError("option 'training_set' is required (an extxyz file or a dataset section)")
    merged["training_set"] = _resolve_datasets(merged["training_set"], "training_set")
    if merged["test_set"] is None:
        merged["test_set"] = 0.0
    for name in ("validation_set", "test_set"):
        merged[name] = _held_out(merged[name], name, merged["training_set"])
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
    return merged


def indices_only(option) -> bool:
    """Whether a ``validation_set``/``test_set`` option is metatrain's indices-only form,
    ``{indices: [...]}``: structures of the (one) training file."""
    return isinstance(option, Mapping) and set(option) == {"indices"}


def _held_out(value, where: str, training):
    """A validated ``validation_set``/``test_set``: a fraction in [0, 1) of every
    training file, or one dataset per training dataset."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"option '{where}' must be a fraction in [0, 1) or a dataset")
    if isinstance(value, (int, float)):
        value = _number(value, where, minimum=0.0)
        if not value < 1.0:
            raise ValueError(f"option '{where}' as a fraction must be below 1, got {value!r}")
        return float(value)
    if indices_only(value):
        # metatrain's indices-only form: structures of the (one) training file
        if isinstance(training, list) and len(training) > 1:
            raise ValueError(
                f"option '{where}': indices alone need a single training dataset (as in "
                "metatrain); give each validation dataset its systems, targets and indices"
            )
        return {"indices": load_indices(value["indices"], f"{where}.indices")}
    value = _resolve_datasets(value, where)
    n_train, n_held = (len(x) if isinstance(x, list) else 1 for x in (training, value))
    if n_train != n_held:
        raise ValueError(
            f"option '{where}' lists {n_held} dataset(s) but 'training_set' lists {n_train}: "
            f"give one {where.split('_')[0]} dataset per training dataset (as metatrain does), or a fraction"
        )
    return value


def _resolve_datasets(value, where: str):
    """One dataset section, or a list of them (metatrain's several datasets)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"option '{where}' is an empty list")
        return [resolve_dataset(item, f"{where}[{i}]") for i, item in enumerate(value)]
    return resolve_dataset(value, where)


def dataset_sections(value) -> list:
    """The resolved ``training_set``/``validation_set`` option as a list of sections."""
    return list(value) if isinstance(value, list) else [value]


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


def trained_parameters(finetune: Mapping) -> tuple[str, ...] | None:
    """The ``train`` selection (:func:`petfunc.train.trainable`) of a validated
    ``finetune`` section: ``None`` (everything) for ``method: full``, the adapters
    (:data:`petfunc.lora.TRAIN`) for ``lora``; for ``heads``,
    ``config.head_modules + config.last_layer_modules`` are path prefixes
    (metatrain's module names, with or without ``backend.``). An empty ``config``
    means metatrain's documented default, the node and edge heads and last layers."""
    method = finetune.get("method", "full")
    if method == "lora":
        from petfunc.lora import TRAIN

        return TRAIN
    if method != "heads":
        return None
    from petfunc.train import HEADS

    config = finetune.get("config") or {}
    if not config:
        return HEADS
    names = list(config.get("head_modules", [])) + list(config.get("last_layer_modules", []))
    return tuple(name[len("backend.") :] if name.startswith("backend.") else name for name in names)
