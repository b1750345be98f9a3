"""Dataset sections of the options: ``training_set``, ``validation_set``, ``test_set``.

:func:`resolve_dataset` expands one section (metatrain's shorthands included) to its
full form; :func:`resolve_datasets` a section or a list of them; :func:`held_out` a
validation or test set (a fraction, datasets, or indices of the training file).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from petfunc.trainer.options.checks import check_keys, number
from petfunc.trainer.options.targets import check_target_name
from petfunc.units import energy_unit_factor, length_unit_factor


GRADIENTS = ("forces", "stress", "virial")  # the labels of an energy target's derivatives

#: keys of an energy target section (metatrain's)
TARGET_KEYS = (
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
)


def gradient(value, default_key: str, where: str):
    """``False``, ``"auto"`` or ``{"key": ...}`` for a forces/stress/virial entry
    (``default_key``: the key of ``true``; ``where``: the entry's dotted name)."""
    if value is None or value is False:
        return False
    if value == "auto":
        return "auto"
    if value is True:
        return {"key": default_key}
    if isinstance(value, str):  # metatrain: a path to read from
        return {"key": default_key, "read_from": value}
    if isinstance(value, Mapping):
        check_keys(value, ("key", "read_from", "reader"), where)
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
         "targets": {"energy": {"key", "unit", "forces", "stress", "virial"}},
         "extra_data": {"charge", "spin_multiplicity"}}

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
    check_keys(section, ("systems", "targets", "extra_data", "indices"), where)
    systems = section.get("systems")
    if isinstance(systems, (str, Path)):
        systems = {"read_from": str(systems)}
    if not isinstance(systems, Mapping) or systems.get("read_from") is None:
        raise ValueError(f"option '{where}.systems' must name a file (systems: {{read_from: FILE}})")
    check_keys(systems, ("read_from", "reader", "length_unit"), f"{where}.systems")
    if systems.get("reader") not in (None, "ase"):
        raise ValueError(f"option '{where}.systems.reader': only the 'ase' reader is supported")
    length_unit = systems.get("length_unit") or "angstrom"
    length_unit_factor(length_unit)
    read_from = str(systems["read_from"])
    out = {
        "systems": {"read_from": read_from, "length_unit": length_unit},
        "targets": {"energy": energy_target(section.get("targets"), where, read_from)},
        "extra_data": extra_data(section.get("extra_data") or {}, f"{where}.extra_data", read_from),
    }
    if section.get("indices") is not None:
        out["indices"] = load_indices(section["indices"], f"{where}.indices")
    return out


def energy_target(targets, where: str, read_from: str) -> dict:
    """The resolved energy target of a dataset section's ``targets`` (``None``: the
    defaults): ``{"key", "unit", "forces", "stress", "virial"}`` (and ``description``).
    ``read_from`` is the section's systems file, the only source of labels."""
    if targets is None:
        targets = {"energy": {}}
    if not isinstance(targets, Mapping):
        raise ValueError(f"option '{where}.targets' must be a mapping")
    # one energy target; metatrain names others "mtt::NAME" (key: the name by default)
    for given in targets:
        check_target_name(given, f"{where}.targets")
    name = "energy"
    if len(targets) == 1 and "energy" not in targets:
        (name,) = targets
    check_keys(targets, (name,), f"{where}.targets")
    energy = targets.get(name, {})
    if energy is None:
        energy = {}
    if isinstance(energy, str):
        energy = {"read_from": energy}
    where_e = f"{where}.targets.{name}"
    check_keys(energy, TARGET_KEYS, where_e)
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
        "forces": gradient(energy.get("forces", gradient_default), "forces", f"{where_e}.forces"),
        "stress": gradient(energy.get("stress", gradient_default), "stress", f"{where_e}.stress"),
        "virial": gradient(energy.get("virial", False), "virial", f"{where_e}.virial"),
    }
    for name in GRADIENTS:
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
    return resolved


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


def extra_data(section, where: str, read_from: str) -> dict:
    """``{"charge": key | None, "spin_multiplicity": key | None}`` from metatrain's
    ``extra_data: {charge: {key: K}, spin_multiplicity: {key: K}}`` (or ``charge: K``;
    ``None`` keeps the default keys, so a resolved section resolves to itself)."""
    check_keys(section, ("charge", "spin_multiplicity"), where)
    out = {"charge": None, "spin_multiplicity": None}
    for name, entry in section.items():
        if entry is None:  # resolved form: the default keys
            continue
        if isinstance(entry, str):
            entry = {"key": entry}
        check_keys(
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


def indices_only(option) -> bool:
    """Whether a ``validation_set``/``test_set`` option is metatrain's indices-only form,
    ``{indices: [...]}``: structures of the (one) training file."""
    return isinstance(option, Mapping) and set(option) == {"indices"}


def held_out(value, where: str, training):
    """A validated ``validation_set``/``test_set``: a fraction in [0, 1) of every
    training file, or one dataset per training dataset."""
    if isinstance(value, bool) or value is None:
        raise ValueError(f"option '{where}' must be a fraction in [0, 1) or a dataset")
    if isinstance(value, (int, float)):
        value = number(value, where, minimum=0.0)
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
    value = resolve_datasets(value, where)
    n_train, n_held = (len(x) if isinstance(x, list) else 1 for x in (training, value))
    if n_train != n_held:
        raise ValueError(
            f"option '{where}' lists {n_held} dataset(s) but 'training_set' lists {n_train}: "
            f"give one {where.split('_')[0]} dataset per training dataset (as metatrain does), or a fraction"
        )
    return value


def resolve_datasets(value, where: str):
    """One dataset section, or a list of them (metatrain's several datasets)."""
    if isinstance(value, (list, tuple)):
        if not value:
            raise ValueError(f"option '{where}' is an empty list")
        return [resolve_dataset(item, f"{where}[{i}]") for i, item in enumerate(value)]
    return resolve_dataset(value, where)


def dataset_sections(value) -> list:
    """The resolved ``training_set``/``validation_set`` option as a list of sections."""
    return list(value) if isinstance(value, list) else [value]


def energy_target_name(training_set) -> str:
    """The name of the energy target in a (raw) ``training_set`` option: ``energy``,
    or metatrain's ``mtt::NAME`` of a dataset whose one target is named so."""
    sections = training_set if isinstance(training_set, list) else [training_set]
    for section in sections:
        targets = section.get("targets") if isinstance(section, Mapping) else None
        if isinstance(targets, Mapping) and len(targets) == 1:
            return str(next(iter(targets)))
    return "energy"
