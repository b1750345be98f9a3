"""The dataset file of ``petfunc eval MODEL DATASET.yaml``: metatrain's dataset
section (``mtt eval``'s options file), or a list of them, read with the parser of
the options' dataset sections (:func:`petfunc.trainer.options.resolve_datasets`)::

    systems:
      read_from: test.xyz      # relative to the working folder, as in mtt eval
      length_unit: angstrom
    targets:
      energy:
        key: U0
        unit: kcal/mol
        forces: {key: F}       # true, false, a key, or {key: K}
        stress: false          # or virial: {key: W}
    extra_data: {charge: {key: q}}

A label named in the file must be in it; ``forces`` and ``stress`` left out are
read when the file has them. Without a ``targets`` section, the keys and units are
those the model was trained on (as ``petfunc eval`` reads an extxyz file).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from petfunc.cli.options import read_options_file, yaml_load
from petfunc.trainer.options import resolve_datasets


#: the suffixes of a dataset file (anything else is a structure file)
DATASET_SUFFIXES = (".yaml", ".yml")


@dataclass
class EvalDataset:
    """One dataset of a dataset file: its structure file, and the label options of
    :func:`petfunc.trainer.evaluate` it sets (``None``: as the model was trained;
    ``""``: not read); ``required``: the label keys the file must have."""

    read_from: str
    labels: dict = field(default_factory=dict)
    required: list = field(default_factory=list)


def is_dataset_file(path) -> bool:
    """Whether ``path`` names a dataset file (YAML) rather than a structure file."""
    return Path(path).suffix.lower() in DATASET_SUFFIXES


def read_dataset_file(path) -> list[EvalDataset]:
    """The datasets of the YAML file ``path`` (one section, or a list of them).

    Raises:
        ValueError: not a dataset section (the file and the key are named), or one
            with ``indices`` (``petfunc eval`` evaluates every structure).
        FileNotFoundError: no such file.
    """
    where = str(path)
    try:
        raw = read_options_file(path)
    except ValueError as error:
        if "must hold a mapping" not in str(error):
            raise
        raw = read_list(path)
    sections = raw if isinstance(raw, list) else [raw]
    resolved = resolve_datasets(raw, where)
    resolved = resolved if isinstance(resolved, list) else [resolved]
    datasets = []
    for i, (given, section) in enumerate(zip(sections, resolved)):
        name = f"{where}[{i}]" if isinstance(raw, list) else where
        if "indices" in section:
            raise ValueError(
                f"option '{name}.indices': petfunc eval evaluates every structure of the file; "
                "write the structures to evaluate to a file of their own"
            )
        datasets.append(eval_dataset(given, section))
    return datasets


def read_list(path) -> list:
    """A dataset file that holds a list of sections."""
    with open(path, encoding="utf-8") as handle:
        data = yaml_load(handle)
    if not isinstance(data, list):
        raise ValueError(
            f"dataset file {str(path)!r} must hold a dataset section (systems, targets) or a list of them, "
            f"got {type(data).__name__}"
        )
    return data


def eval_dataset(given, section: Mapping) -> EvalDataset:
    """The :class:`EvalDataset` of the resolved ``section``; ``given`` is the section
    as written (units and targets left out are the model's)."""
    dataset = EvalDataset(section["systems"]["read_from"])
    labels = dataset.labels
    given = given if isinstance(given, Mapping) else {}
    systems = given.get("systems")
    if isinstance(systems, Mapping) and systems.get("length_unit"):
        labels["length_unit"] = section["systems"]["length_unit"]
    extra = section.get("extra_data") or {}
    labels["charge_key"] = extra.get("charge")
    labels["spin_key"] = extra.get("spin_multiplicity")
    targets = given.get("targets")
    if not isinstance(targets, Mapping):
        return dataset  # keys and units as the model was trained
    energy = section["targets"]["energy"]
    labels["energy_key"] = energy["key"]
    dataset.required.append(energy["key"])
    (written,) = targets.values()
    if isinstance(written, Mapping) and written.get("unit"):
        labels["energy_unit"] = energy["unit"]
    for name in ("forces", "stress", "virial"):
        value = energy[name]
        if value == "auto":
            labels[f"{name}_key"] = name  # read when the file has it
        elif isinstance(value, Mapping):
            labels[f"{name}_key"] = value["key"]
            dataset.required.append(value["key"])
        else:
            labels[f"{name}_key"] = ""  # not read
    return dataset


def numbered(path: str | None, index: int, count: int) -> str | None:
    """The output file of dataset ``index`` of ``count``: ``path`` itself for one
    dataset, else ``STEM_INDEX.SUFFIX`` (metatrain's names)."""
    if path is None or count == 1:
        return path
    path = Path(path)
    return str(path.with_name(f"{path.stem}_{index}{path.suffix}"))
