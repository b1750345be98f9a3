"""The dataset files of a ``petfunc train`` run, read and split as its options say.

:func:`read_training_files` reads the ``training_set``, ``validation_set`` and
``test_set`` of resolved options (one dataset or a list of them), splits each
training file the way ``mtt train`` does (same seed, same structures, same order),
keeps a restart on the split of the run it continues, and chooses the label keys
of every file (:mod:`petfunc.data.read`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from petfunc.config import PETConfig
from petfunc.data import (
    Labels,
    Sample,
    available_keys,
    check_info_keys,
    has_key,
    read_frames,
    require_complete_labels,
    restart_split,
    split_datasets,
    to_samples,
)
from petfunc.train import LossTerm, LossWeights
from petfunc.trainer.options import dataset_sections, indices_only
from petfunc.units import energy_unit_factor, length_unit_factor


@dataclass
class TrainingFiles:
    """What :func:`read_training_files` read.

    Attributes:
        train_parts, val_parts, test_parts: one ``(frames, section, file indices,
            option name)`` per file (indices ``None`` for a separate file).
        train_labels, val_labels, test_labels: the label keys of each part.
        weights: the loss weights, without terms no training file has labels for.
        split: ``{"training": [...], "validation": [...], "test": [...]}`` file
            indices per training file, as stored in checkpoints.
    """

    train_parts: list
    val_parts: list
    train_labels: list[Labels]
    val_labels: list[Labels]
    weights: LossWeights
    split: dict
    test_parts: list = field(default_factory=list)
    test_labels: list[Labels] = field(default_factory=list)

    @property
    def atomic_types(self) -> list[int]:
        """Every atomic number in the training and validation structures, sorted: the
        model's types, as in metatrain (the test set must not change the model)."""
        return _types_of(self.train_parts + self.val_parts)

    @property
    def validation_only_types(self) -> list[int]:
        """Atomic numbers found in the validation structures and in no training one."""
        return sorted(set(_types_of(self.val_parts)) - set(_types_of(self.train_parts)))

    @property
    def train_sizes(self) -> list[int]:
        """Training structures per file, in the order of :meth:`samples`."""
        return [len(part[0]) for part in self.train_parts]

    @property
    def val_sizes(self) -> list[int]:
        """Validation structures per file, in the order of :meth:`samples`."""
        return [len(part[0]) for part in self.val_parts]

    def samples(self, config: PETConfig) -> tuple[list[Sample], list[Sample]]:
        """``(training, validation)`` samples for ``config``; errors name each
        structure by its index in its file."""
        return (
            _samples(self.train_parts, self.train_labels, config),
            _samples(self.val_parts, self.val_labels, config),
        )

    def test_samples(self, config: PETConfig) -> list[Sample]:
        """The test set's samples for ``config`` (empty without ``test_set``); a type
        the model lacks is an error before training (metatrain fails after it)."""
        unknown = sorted(set(_types_of(self.test_parts)) - set(config.atomic_types))
        if unknown:
            raise ValueError(
                f"the test set has atomic type(s) {unknown} that the model lacks (it has "
                f"{list(config.atomic_types)}, from the training and validation sets): it cannot predict "
                "their structures; move some to the training set, or leave them out of the test set"
            )
        return _samples(self.test_parts, self.test_labels, config)


def _types_of(parts) -> list[int]:
    return sorted({int(z) for part in parts for a in part[0] for z in a.numbers})


def _samples(parts, labels, config: PETConfig) -> list[Sample]:
    samples = []
    for (frames, section, idx, _), label in zip(parts, labels):
        samples += to_samples(frames, config, label, section["systems"]["read_from"], idx, for_loss=True)
    return samples


def _check_split_options(options: Mapping, ckpt: Mapping) -> None:
    """A restart keeps the split of the run it continues; options that ask for another
    one (a new validation or test fraction, a fraction instead of a file) are an
    error, not silently ignored."""
    try:
        before = json.loads(ckpt.get("options") or "{}")
    except (TypeError, ValueError):
        return
    for name in ("validation_set", "test_set"):
        if name not in before:
            continue
        old, new = before[name], options.get(name)
        old, new = (0.0 if old is None else old), (0.0 if new is None else new)  # None: no such set
        fraction_old, fraction_new = isinstance(old, (int, float)), isinstance(new, (int, float))
        if (fraction_old, fraction_new) == (True, True) and float(old) == float(new):
            continue
        only_old, only_new = indices_only(old), indices_only(new)
        if fraction_old or fraction_new or ((only_old or only_new) and old != new):

            def show(value):
                if isinstance(value, (int, float)):
                    return f"{value:g}"
                if indices_only(value):
                    return f"indices {value['indices'][:5]}{'...' if len(value['indices']) > 5 else ''}"
                return "a separate file"

            raise ValueError(
                f"option '{name}' is {show(new)} here, {show(old)} in the run the restart checkpoint "
                "continues: a restart keeps that run's split, so that no structure moves between "
                "the sets. Set it back, or start a new run from the checkpoint's weights "
                "(architecture.training.finetune.read_from)"
            )


def _checked_indices(indices, n: int, where: str) -> np.ndarray:
    """``indices`` (all of ``range(n)`` when ``None``) as an array, each below ``n``."""
    if indices is None:
        return np.arange(n)
    indices = np.asarray(indices, dtype=np.int64).reshape(-1)
    if len(indices) and indices.max() >= n:
        raise ValueError(
            f"option '{where}': index {int(indices.max())} is out of range for a file of {n} structures"
        )
    return indices


def _subset(frames, section: Mapping, where: str):
    """A separate validation or test file's structures at its ``indices`` (all without)."""
    if section.get("indices") is None:
        return frames
    return [frames[j] for j in _checked_indices(section["indices"], len(frames), where + ".indices")]


def content_digest(frames) -> str:
    """A short SHA-256 of structures as read: species, positions, cell, pbc, the
    calculator results (ASE's energy, forces, stress), ``info`` and per-atom arrays."""
    import hashlib

    digest = hashlib.sha256()

    def add(key, value):
        digest.update(str(key).encode())
        array = np.asarray(value)
        digest.update(array.tobytes() if array.dtype.kind in "biufc" else repr(value).encode())

    for atoms in frames:
        add("cell", atoms.cell.array)
        add("pbc", atoms.pbc)
        for key in sorted(atoms.arrays):
            add(key, atoms.arrays[key])
        for key in sorted(atoms.info):
            add(key, atoms.info[key])
        results = atoms.calc.results if atoms.calc is not None else {}
        for key in sorted(results):
            add(key, results[key])
    return digest.hexdigest()[:16]


def read_training_files(
    options: Mapping,
    weights: LossWeights,
    explicit: set,
    seed: int,
    ckpt: Mapping | None = None,
    log: Callable[[str], None] = print,
) -> TrainingFiles:
    """Read and split the ``training_set``, ``validation_set`` and ``test_set`` of
    resolved ``options`` (one dataset or a list of them; each file is split on its
    own).

    ``explicit`` names the loss terms the options ask for, whose labels must then be
    in some training file; a restart checkpoint ``ckpt`` brings its split.
    """
    # one or several datasets (metatrain's list form); each is split on its own
    train_sections = dataset_sections(options["training_set"])
    val_option = options["validation_set"]
    test_option = options.get("test_set", 0.0)

    def own_sections(option):
        """the dataset sections of a validation or test set read from files of its own"""
        return None if isinstance(option, (int, float)) or indices_only(option) else dataset_sections(option)

    val_sections, test_sections = own_sections(val_option), own_sections(test_option)
    val_fraction = float(val_option) if isinstance(val_option, (int, float)) else 0.0
    test_fraction = float(test_option) if isinstance(test_option, (int, float)) else 0.0
    many = len(train_sections) > 1

    def where(name, i):
        return f"{name}[{i}]" if many else name

    def read_file(section, option):
        """A dataset file's structures, its info keys and labels checked on the whole
        file, before any validation split takes some of its structures."""
        path = section["systems"]["read_from"]
        frames = read_frames(path, option)
        check_info_keys(frames, section.get("extra_data") or {}, path, option + ".extra_data.")
        require_complete_labels(
            frames, label_keys(frames, section, weights, set(), option), path, where=option
        )
        return frames

    def read_files(sections, name):
        return [read_file(section, where(name, i)) for i, section in enumerate(sections or [])]

    files = read_files(train_sections, "training_set")
    val_files = [
        _subset(f, sec, f"validation_set[{i}]" if many else "validation_set")
        for i, (f, sec) in enumerate(zip(read_files(val_sections, "validation_set"), val_sections or []))
    ]
    test_files = [
        _subset(f, sec, f"test_set[{i}]" if many else "test_set")
        for i, (f, sec) in enumerate(zip(read_files(test_sections, "test_set"), test_sections or []))
    ]
    sizes = [len(f) for f in files]
    # metatrain's explicit indices: a training file's structures, before any split
    chosen = [
        _checked_indices(section.get("indices"), len(f), where("training_set", i) + ".indices")
        for i, (f, section) in enumerate(zip(files, train_sections))
    ]
    explicit_indices = (
        any(section.get("indices") is not None for section in train_sections)
        or indices_only(val_option)
        or indices_only(test_option)
    )
    if ckpt is not None:  # a restart trains on the structures of the run it continues
        _check_split_options(options, ckpt)
        splits = restart_split(
            ckpt, sizes, None if val_sections else val_fraction, seed, partition=not explicit_indices
        )
    else:
        # a separate file or indices-only set draws nothing (metatrain shuffles then not)
        splits = split_datasets(
            [len(c) for c in chosen],
            None if val_sections or indices_only(val_option) else val_fraction,
            seed,
            None if test_sections or indices_only(test_option) else test_fraction,
        )
        # positions in the chosen structures -> indices in the file
        splits = [tuple(c[part] for part in parts) for c, parts in zip(chosen, splits)]
        for name, option, k in (("validation_set", val_option, 1), ("test_set", test_option, 2)):
            if indices_only(option):  # as metatrain: taken from the whole file, training kept as it is
                idx = _checked_indices(option["indices"], sizes[0], f"{name}.indices")
                train = splits[0][0]
                overlap = np.intersect1d(train, idx)
                if len(overlap):
                    log(
                        f"warning: {name}.indices and the training structures share {len(overlap)} structure(s) "
                        f"(for example {overlap[:5].tolist()}); metatrain does not remove them from training either"
                    )
                parts = list(splits[0])
                parts[k] = idx
                splits[0] = tuple(parts)
    # (frames, section, file indices, option name) of every training, validation and test part
    train_parts, val_parts, test_parts = [], [], []
    for i, (frames, section, (train_idx, val_idx, test_idx)) in enumerate(zip(files, train_sections, splits)):
        train_parts.append(([frames[j] for j in train_idx], section, train_idx, where("training_set", i)))
        for name, option, sections, idx, parts in (
            ("validation_set", val_option, val_sections, val_idx, val_parts),
            ("test_set", test_option, test_sections, test_idx, test_parts),
        ):
            if sections is not None:
                continue
            use = "validation" if name == "validation_set" else "testing"
            fraction = option if isinstance(option, (int, float)) else 0.0
            if fraction > 0 and not len(idx) and ckpt is None:
                log(
                    f"warning: {name} {fraction:g} of the {len(frames)} structures of "
                    f"{section['systems']['read_from']} is less than one; none of them is used for {use}"
                )
            elif fraction > 0 and not len(idx):
                log(
                    f"warning: the split of the restarted run uses none of the structures of "
                    f"{section['systems']['read_from']} for {use}; {name} {fraction:g} is ignored"
                )
            if len(idx):
                parts.append(([frames[j] for j in idx], section, idx, where(name, i)))
    for name, sections, separate, parts in (
        ("validation_set", val_sections, val_files, val_parts),
        ("test_set", test_sections, test_files, test_parts),
    ):
        for i, (frames, section) in enumerate(zip(separate, sections or [])):
            parts.append((frames, section, None, where(name, i)))
    # file indices of every part, stored in checkpoints for restarts
    split_json = {
        name: [[int(j) for j in split[k]] for split in splits]
        for k, name in enumerate(("training", "validation", "test"))
    }
    # and a digest of each training file's content: a restart says when a file changed
    # (the indices only catch another number of structures)
    # (separate validation and test files too: they pick the best epoch)
    changed = []
    for key, name, frames_of in (
        ("digests", "training_set", files),
        ("validation_digests", "validation_set", val_files),
        ("test_digests", "test_set", test_files),
    ):
        split_json[key] = [content_digest(frames) for frames in frames_of]
        stored = (ckpt.get("split") or {}).get(key) if ckpt is not None else None
        if stored is not None:
            changed += [where(name, i) for i, (a, b) in enumerate(zip(stored, split_json[key])) if a != b]
    if changed:
        log(
            f"warning: {', '.join(changed)} changed since the checkpoint (the same number of structures, other "
            "positions, cells, species or labels): the restart uses the files as they are now"
        )

    # labels: a loss term the options ask for must have labels in some training file;
    # structures of files without them get NaN labels, which the loss skips
    train_labels = [
        label_keys(f, sec, weights, explicit if not many else set(), w) for f, sec, _, w in train_parts
    ]
    for term in sorted(explicit) if many else ():
        names = ("forces",) if term == "forces" else ("stress", "virial")
        if not any(getattr(lab, n) for lab in train_labels for n in names):
            f, sec, _, w = train_parts[0]
            label_keys(f, sec, weights, {term}, w)  # raises, naming the first file
    val_labels = [label_keys(f, sec, weights, set(), w) for f, sec, _, w in val_parts]
    test_labels = [label_keys(f, sec, weights, set(), w) for f, sec, _, w in test_parts]
    has = {name: any(getattr(lab, name) for lab in train_labels) for name in ("forces", "stress", "virial")}
    # terms without any training labels are dropped (no derivative is computed for them)
    for term, found in (("forces", has["forces"]), ("stress", has["stress"] or has["virial"])):
        # as metatrain's "No forces found": a term not switched off, found nowhere
        sought = set()
        for _, section, _, _ in train_parts:
            value = section["targets"]["energy"].get(term)
            if value == "auto":
                sought.add(term)
            elif isinstance(value, dict):
                sought.add(value["key"])
        if getattr(weights, term).weight > 0 and not found and sought:
            log(
                f"no {term} labels in the training files (looked for {', '.join(map(repr, sorted(sought)))}): "
                f"training without the {term} term"
            )
    weights = dataclasses.replace(
        weights,
        forces=weights.forces if has["forces"] else LossTerm(0.0, weights.forces.type),
        stress=weights.stress if (has["stress"] or has["virial"]) else LossTerm(0.0, weights.stress.type),
    )

    return TrainingFiles(
        train_parts, val_parts, train_labels, val_labels, weights, split_json, test_parts, test_labels
    )


def label_keys(frames, section: Mapping, weights: LossWeights, explicit: set, where: str) -> Labels:
    """Which keys to read; raises when requested labels are missing from the file."""
    path = section["systems"]["read_from"]
    target = section["targets"]["energy"]

    def present(key):
        return sum(has_key(a, key) for a in frames)

    def missing(what, key, how):
        keys = available_keys(frames)
        return ValueError(
            f"{where}: {how}, but no structure in {path!r} has {what} labels under the key "
            f"{key!r} (keys in the file: {keys}). Set '{where}.targets.energy.{what}' to the right "
            f"key, or to false to train without {what} (and drop any {what} weight from the "
            "'architecture.training.loss' option)."
        )

    energy = target["key"]
    if weights.energy.weight > 0 and not present(energy):
        keys = available_keys(frames)
        raise ValueError(
            f"{where}: no structure in {path!r} has an energy under the key {energy!r} "
            f"(keys in the file: {keys}); set '{where}.targets.energy.key'"
        )
    keys = {}
    for name, term in (("forces", weights.forces), ("stress", weights.stress), ("virial", weights.stress)):
        spec = target[name]
        if spec is False:
            keys[name] = None
            continue
        key = name if spec == "auto" else spec["key"]
        if present(key):
            keys[name] = key
            continue
        keys[name] = None
        loss_term = "forces" if name == "forces" else "stress"
        if spec != "auto":
            raise missing(name, key, f"'{where}.targets.energy.{name}' asks for {name}")
        if loss_term in explicit and not (name == "stress" and target["virial"]):
            raise missing(name, key, f"the loss has a {loss_term} term (weight {term.weight})")
    extra = section.get("extra_data") or {}
    return Labels(
        energy,
        keys["forces"],
        keys["stress"],
        keys["virial"],
        energy_unit_factor(target["unit"]),
        length_unit_factor(section["systems"]["length_unit"]),
        extra.get("charge"),
        extra.get("spin_multiplicity"),
    )
