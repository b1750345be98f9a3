"""The dataset files of a ``petfunc train`` run, read and split as its options say.

:func:`read_training_files` reads the ``training_set``, ``validation_set`` and
``test_set`` of resolved options (one dataset or a list of them), splits each
training file the way ``mtt train`` does (same seed, same structures, same order),
keeps a restart on the split of the run it continues, and chooses the label keys
of every file (:mod:`petfunc.trainer.labels`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np

from petfunc.config import PETConfig
from petfunc.data import (
    Labels,
    Sample,
    check_info_keys,
    read_frames,
    require_complete_labels,
    restart_split,
    split_datasets,
    to_samples,
)
from petfunc.train import LossWeights
from petfunc.trainer.labels import label_keys, training_labels
from petfunc.trainer.options import dataset_sections, indices_only


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


def check_split_options(options: Mapping, ckpt: Mapping) -> None:
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


def checked_indices(indices, n: int, where: str) -> np.ndarray:
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
    return [frames[j] for j in checked_indices(section["indices"], len(frames), where + ".indices")]


def content_digest(frames) -> str:
    """A short SHA-256 of structures as read: species, positions, cell, pbc, the
    calculator results (ASE's energy, forces, stress), ``info`` and per-atom arrays."""
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


class _Layout:
    """Where the structures of a run come from: the training dataset sections, and
    the validation and test options (a fraction, indices of the training file, or
    sections of their own)."""

    def __init__(self, options: Mapping):
        self.train_sections = dataset_sections(options["training_set"])
        self.val_option = options["validation_set"]
        self.test_option = options.get("test_set", 0.0)
        self.val_sections = self._own_sections(self.val_option)
        self.test_sections = self._own_sections(self.test_option)
        self.val_fraction = self._fraction(self.val_option)
        self.test_fraction = self._fraction(self.test_option)
        self.many = len(self.train_sections) > 1

    @staticmethod
    def _own_sections(option):
        """the dataset sections of a validation or test set read from files of its own"""
        return None if isinstance(option, (int, float)) or indices_only(option) else dataset_sections(option)

    @staticmethod
    def _fraction(option) -> float:
        return float(option) if isinstance(option, (int, float)) else 0.0

    def where(self, name: str, i: int) -> str:
        """The option that names file ``i`` of ``name``, as errors and logs give it."""
        return f"{name}[{i}]" if self.many else name


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
    layout = _Layout(options)
    files = _read_files(layout, layout.train_sections, "training_set", weights)
    val_files = _read_separate(layout, layout.val_sections, "validation_set", weights)
    test_files = _read_separate(layout, layout.test_sections, "test_set", weights)
    splits = _split(layout, files, options, seed, ckpt, log)
    train_parts, val_parts, test_parts = _parts(layout, files, splits, ckpt, log)
    for name, sections, separate, parts in (
        ("validation_set", layout.val_sections, val_files, val_parts),
        ("test_set", layout.test_sections, test_files, test_parts),
    ):
        for i, (frames, section) in enumerate(zip(separate, sections or [])):
            parts.append((frames, section, None, layout.where(name, i)))
    split_json = _split_record(layout, splits, (files, val_files, test_files), ckpt, log)
    labels, weights = training_labels(
        (train_parts, val_parts, test_parts), weights, explicit, layout.many, log
    )
    train_labels, val_labels, test_labels = labels
    return TrainingFiles(
        train_parts, val_parts, train_labels, val_labels, weights, split_json, test_parts, test_labels
    )


def _read_files(layout: _Layout, sections, name: str, weights: LossWeights) -> list:
    """The structures of each dataset file of ``sections`` (option ``name``), their
    info keys and labels checked on the whole file, before any validation split takes
    some of its structures."""
    out = []
    for i, section in enumerate(sections or []):
        option = layout.where(name, i)
        path = section["systems"]["read_from"]
        frames = read_frames(path, option)
        check_info_keys(frames, section.get("extra_data") or {}, path, option + ".extra_data.")
        require_complete_labels(
            frames, label_keys(frames, section, weights, set(), option), path, where=option
        )
        out.append(frames)
    return out


def _read_separate(layout: _Layout, sections, name: str, weights: LossWeights) -> list:
    """The structures of a validation or test set's own files, at their ``indices``."""
    return [
        _subset(frames, section, layout.where(name, i))
        for i, (frames, section) in enumerate(
            zip(_read_files(layout, sections, name, weights), sections or [])
        )
    ]


def _split(layout: _Layout, files, options: Mapping, seed: int, ckpt, log) -> list:
    """``(train, validation, test)`` file indices of every training file: drawn as
    ``mtt train`` draws them, or, for a restart, those of the run it continues."""
    train_sections, val_option, test_option = layout.train_sections, layout.val_option, layout.test_option
    sizes = [len(f) for f in files]
    # metatrain's explicit indices: a training file's structures, before any split
    chosen = [
        checked_indices(section.get("indices"), len(f), layout.where("training_set", i) + ".indices")
        for i, (f, section) in enumerate(zip(files, train_sections))
    ]
    explicit_indices = (
        any(section.get("indices") is not None for section in train_sections)
        or indices_only(val_option)
        or indices_only(test_option)
    )
    if ckpt is not None:  # a restart trains on the structures of the run it continues
        check_split_options(options, ckpt)
        return restart_split(
            ckpt,
            sizes,
            None if layout.val_sections else layout.val_fraction,
            seed,
            partition=not explicit_indices,
        )
    # a separate file or indices-only set draws nothing (metatrain shuffles then not)
    splits = split_datasets(
        [len(c) for c in chosen],
        None if layout.val_sections or indices_only(val_option) else layout.val_fraction,
        seed,
        None if layout.test_sections or indices_only(test_option) else layout.test_fraction,
    )
    # positions in the chosen structures -> indices in the file
    splits = [tuple(c[part] for part in parts) for c, parts in zip(chosen, splits)]
    for name, option, k in (("validation_set", val_option, 1), ("test_set", test_option, 2)):
        if indices_only(option):  # as metatrain: taken from the whole file, training kept as it is
            idx = checked_indices(option["indices"], sizes[0], f"{name}.indices")
            train = splits[0][0]
            overlap = np.intersect1d(train, idx)
            if len(overlap):
                log(
                    f"warning: {name}.indices and the training structures share {len(overlap)} structure(s) "
                    f"(for example {overlap[:5].tolist()}); "
                    "metatrain does not remove them from training either"
                )
            parts = list(splits[0])
            parts[k] = idx
            splits[0] = tuple(parts)
    return splits


def _parts(layout: _Layout, files, splits, ckpt, log) -> tuple[list, list, list]:
    """``(frames, section, file indices, option name)`` of every training part, and of
    the validation and test parts split off the training files."""
    train_parts, val_parts, test_parts = [], [], []
    for i, (frames, section, (train_idx, val_idx, test_idx)) in enumerate(
        zip(files, layout.train_sections, splits)
    ):
        train_parts.append(
            ([frames[j] for j in train_idx], section, train_idx, layout.where("training_set", i))
        )
        for name, option, sections, idx, parts in (
            ("validation_set", layout.val_option, layout.val_sections, val_idx, val_parts),
            ("test_set", layout.test_option, layout.test_sections, test_idx, test_parts),
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
                parts.append(([frames[j] for j in idx], section, idx, layout.where(name, i)))
    return train_parts, val_parts, test_parts


def _split_record(layout: _Layout, splits, frames_of, ckpt, log) -> dict:
    """The split as checkpoints store it: file indices of every part, per training
    file, and a digest of each file's content (``frames_of``: the training,
    validation and test files), so that a restart says when a file changed (the
    indices only catch another number of structures); separate validation and test
    files too, as they pick the best epoch."""
    split_json = {
        name: [[int(j) for j in split[k]] for split in splits]
        for k, name in enumerate(("training", "validation", "test"))
    }
    changed = []
    for key, name, frames in zip(
        ("digests", "validation_digests", "test_digests"),
        ("training_set", "validation_set", "test_set"),
        frames_of,
    ):
        split_json[key] = [content_digest(f) for f in frames]
        stored = (ckpt.get("split") or {}).get(key) if ckpt is not None else None
        if stored is not None:
            changed += [
                layout.where(name, i) for i, (a, b) in enumerate(zip(stored, split_json[key])) if a != b
            ]
    if changed:
        log(
            f"warning: {', '.join(changed)} changed since the checkpoint "
            "(the same number of structures, other positions, cells, species or labels): "
            "the restart uses the files as they are now"
        )
    return split_json
