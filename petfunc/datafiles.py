"""The labelled structure files of a training run.

Reading extxyz files with ASE, choosing which label keys to read (with errors that
name the file, the key and the option to change), turning frames into
:class:`~petfunc.data.Sample` objects, and splitting each training file into
training and validation structures the way ``mtt train`` does (same seed, same
structures, same order). :func:`read_training_files` does all of it for the
``training_set``/``validation_set`` options of :func:`petfunc.trainer.fit`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, List, Mapping, Optional, Sequence, Tuple

import numpy as np

from .config import PETConfig
from .data import Sample, sample_from_atoms
from .loss import LossTerm, LossWeights
from .options import dataset_sections, energy_unit_factor, indices_only, length_unit_factor


def read_frames(path, where: str, index=":") -> list:
    """The structures of an ASE-readable file (``index`` as for ``ase.io.read``);
    errors start with ``where`` (the option or role of the file) and name it."""
    import ase.io

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{where}: dataset file not found: {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"{where}: {str(path)!r} is not a file")
    try:
        frames = ase.io.read(str(path), index=index)
    except Exception as error:  # ASE raises many kinds of errors on bad files
        raise ValueError(f"{where}: could not read dataset file {str(path)!r}: {type(error).__name__}: {error}") from None
    if not isinstance(frames, list):
        frames = [frames]
    if not frames:
        raise ValueError(f"{where}: dataset file {str(path)!r} holds no structures")
    return frames


def _has_key(atoms, key) -> bool:
    if key in atoms.info or key in atoms.arrays:
        return True
    calc = atoms.calc
    return calc is not None and key in getattr(calc, "results", {})


def _available_keys(frames) -> List[str]:
    keys = set()
    for atoms in frames[:50]:
        keys.update(atoms.info)
        keys.update(k for k in atoms.arrays if k not in ("numbers", "positions"))
        if atoms.calc is not None:
            keys.update(getattr(atoms.calc, "results", {}))
    return sorted(keys)


@dataclass
class Labels:
    energy: Optional[str]
    forces: Optional[str]
    stress: Optional[str]
    virial: Optional[str]
    energy_unit: float
    length_unit: float
    charge: Optional[str] = None  # atoms.info keys for system conditioning (None: defaults)
    spin_multiplicity: Optional[str] = None


def label_keys(frames, section: Mapping, weights: LossWeights, explicit: set, where: str) -> Labels:
    """Which keys to read; raises when requested labels are missing from the file."""
    path = section["systems"]["read_from"]
    target = section["targets"]["energy"]

    def present(key):
        return sum(_has_key(a, key) for a in frames)

    def missing(what, key, how):
        keys = _available_keys(frames)
        return ValueError(
            f"{where}: {how}, but no structure in {path!r} has {what} labels under the key "
            f"{key!r} (keys in the file: {keys}). Set '{where}.targets.energy.{what}' to the right "
            f"key, or to false to train without {what} (and drop any {what} weight from the "
            "'architecture.training.loss' option)."
        )

    energy = target["key"]
    if weights.energy.weight > 0 and not present(energy):
        keys = _available_keys(frames)
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


def check_info_keys(frames, keys: Mapping, path, where: str) -> None:
    """Raise when a named ``atoms.info`` key (charge, spin multiplicity) is in no
    structure of the file: a misspelt key would otherwise give silent defaults."""
    for name, key in keys.items():
        if key is not None and not any(key in a.info for a in frames):
            raise ValueError(
                f"{where}{name}: no structure in {str(path)!r} has the info key {key!r} "
                f"(keys in the file: {_available_keys(frames)})"
            )


def require_complete_labels(frames, labels: Labels, path, where: str = "") -> None:
    """Raise when a label key is in some structures of ``frames`` and not in others.

    Such a structure would silently train without that label. metatrain's reader
    stops there too; a label that is deliberately absent is written as NaN, which
    the loss skips (spec section 9), or its structures go to a file of their own.
    ``frames`` is a whole file, whose indices the error names. (``petfunc eval``
    predicts unlabelled structures too, so only training files are checked.)
    """
    for name in ("energy", "forces", "stress", "virial"):
        key = getattr(labels, name)
        if key is None:
            continue
        lacking = [i for i, atoms in enumerate(frames) if not _has_key(atoms, key)]
        if lacking and len(lacking) < len(frames):
            shown = ", ".join(map(str, lacking[:10])) + (", ..." if len(lacking) > 10 else "")
            prefix = f"{where}: " if where else ""
            raise ValueError(
                f"{prefix}{str(path)!r}: {len(lacking)} of {len(frames)} structures "
                f"{'has' if len(lacking) == 1 else 'have'} no {name} label under the key {key!r} "
                f"(structure{'s' if len(lacking) > 1 else ''} {shown}). Write NaN {name} labels for "
                f"{'it' if len(lacking) == 1 else 'them'} (the loss skips NaN labels) or move "
                f"{'it' if len(lacking) == 1 else 'them'} to a dataset file of its own."
            )


def to_samples(frames, config: PETConfig, labels: Labels, path, indices=None,
               for_loss: bool = False) -> List[Sample]:
    """Samples of ``frames``; errors name ``indices[i]``, the frame's index in the file.

    ``for_loss``: the samples feed the training loss, which cannot use a stress on a
    structure that is not periodic in all three directions (no volume): that is an
    error, and a NaN stress (skipped) is how to say none. Evaluation ignores it.
    """
    samples, no_volume = [], []
    indices = range(len(frames)) if indices is None else indices
    for i, atoms in zip(indices, frames):
        label = f"{path}: structure {i}"
        sample = sample_from_atoms(
            atoms, config, labels.energy, labels.forces, labels.stress, labels.virial,
            labels.energy_unit, labels.length_unit, label=label,
            charge_key=labels.charge, spin_multiplicity_key=labels.spin_multiplicity,
        )
        for name in ("energy", "forces", "stress", "virial"):
            value = getattr(sample, name)
            if value is not None and np.isinf(np.asarray(value)).any():
                raise ValueError(f"{label}: the {name} label is infinite")
        stress = sample.stress
        if for_loss and stress is not None and not np.isnan(stress).all() and np.linalg.det(sample.structure.cell) == 0.0:
            no_volume.append((i, np.asarray(atoms.pbc).tolist()))
        samples.append(sample)
    if no_volume:
        shown = ", ".join(f"{i} (pbc={pbc})" for i, pbc in sorted(no_volume)[:10]) + (", ..." if len(no_volume) > 10 else "")
        many = len(no_volume) > 1
        raise ValueError(
            f"{path}: {len(no_volume)} structure{'s have' if many else ' has'} a stress label but no cell volume: "
            f"structure{'s' if many else ''} {shown}. A stress needs a cell periodic in all three directions; write "
            f"a NaN stress for {'them' if many else 'it'} (the loss skips NaN labels)"
        )
    return samples


def split_indices(n: int, fraction: Optional[float], seed: int) -> Tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` indices into a file of ``n`` structures, drawn as
    ``mtt train`` draws them with the same ``seed``, so both train on the same
    structures, in the same order (which the composition fit's accumulation sees).

    metatrain seeds numpy's global generator and shuffles twice: the validation split
    takes the last ``floor(n * fraction)`` of a shuffled ``range(n)``, then its test
    split (``test_set: 0``, the only one petfunc accepts) shuffles the training part
    again. ``fraction=None`` (a separate validation file) skips the first shuffle.
    As in metatrain, a fraction below ``1/n`` gives no validation structure.
    See :func:`split_datasets` for several files.
    """
    (train, val, _), = split_datasets([n], fraction, seed)
    return train, val


def restart_split(ckpt: Mapping, sizes: Sequence[int], fraction: Optional[float], seed: int,
                  partition: bool = True):
    """The ``(train, validation, test)`` split of the run a checkpoint continues: as
    stored, or for checkpoints written before the split was stored, as those
    versions drew it (a seeded permutation, ``round(fraction * n)`` validation
    structures, both parts sorted, no test set). ``partition``: the parts must
    cover each file exactly (without explicit ``indices``, which may select a
    subset)."""
    empty = np.zeros(0, dtype=np.int64)
    stored = ckpt.get("split")
    if stored is None:
        out = []
        for n in sizes:
            if fraction is None or fraction <= 0:
                out.append((np.arange(n), empty, empty))
                continue
            n_val = max(1, int(round(fraction * n)))
            order = np.random.default_rng(seed).permutation(n)
            out.append((np.sort(order[n_val:]), np.sort(order[:n_val]), empty))
        return out
    train, val = stored["training"], stored["validation"]
    test = stored.get("test") or [[] for _ in train]
    if len(train) != len(sizes) or any(
        max(list(t) + list(v) + list(s), default=-1) >= n or (partition and len(t) + len(v) + len(s) != n)
        for t, v, s, n in zip(train, val, test, sizes)
    ):
        raise ValueError(
            "the training data changed since the checkpoint was written: it was split into "
            f"{[len(t) + len(v) + len(s) for t, v, s in zip(train, val, test)]} structures per file, "
            f"the files now hold {list(sizes)}"
        )
    return [tuple(np.asarray(part, dtype=np.int64) for part in parts) for parts in zip(train, val, test)]


def split_datasets(sizes: Sequence[int], fraction: Optional[float], seed: int,
                   test_fraction: Optional[float] = 0.0):
    """:func:`split_indices` for several files of ``sizes`` structures, with
    metatrain's order of draws from one generator: the validation split of every
    file, then the test split of every training part. Returns ``(train,
    validation, test)`` file indices per file (test empty without a test fraction).

    ``test_fraction``: the fraction of each whole file for the test set
    (``test_set: f``; metatrain's default 0 still reshuffles the training part), or
    ``None`` for a separate test file (no reshuffle)."""
    rng = np.random.RandomState(seed % 2**32)
    # metatrain's running "train_size": each split normalises (train, part) by their sum
    train_size = 1.0
    splits = []
    if fraction is not None and fraction > 0:
        train_size -= fraction
    for n in sizes:
        indices = list(range(n))
        n_val = 0
        if fraction is not None and fraction > 0:
            rng.shuffle(indices)
            n_val = math.floor(n * (fraction / (train_size + fraction)))
            if n_val >= n:
                raise ValueError(
                    f"validation_set: a fraction of {fraction} of {n} structures leaves none for training"
                )
        splits.append((indices[: n - n_val], indices[n - n_val :]))
    if test_fraction is not None:
        train_size -= test_fraction
        if not train_size > 0:
            raise ValueError("validation_set and test_set take all of the data: nothing is left to train on")
    out = []
    for train, val in splits:
        test = []
        if test_fraction is not None:
            order = list(range(len(train)))
            rng.shuffle(order)
            n_test = math.floor(len(train) * (test_fraction / (train_size + test_fraction)))
            if n_test >= len(train):
                raise ValueError(f"test_set: a fraction of {test_fraction} leaves no structure for training")
            test = [train[i] for i in order[len(train) - n_test :]]
            train = [train[i] for i in order[: len(train) - n_test]]
        out.append(tuple(np.array(part, dtype=np.int64) for part in (train, val, test)))
    return out


def read_labelled(path, config: PETConfig, energy_key="energy", forces_key="forces", stress_key="stress",
                  virial_key=None, energy_unit="eV", length_unit="angstrom",
                  charge_key=None, spin_multiplicity_key=None, require_labels: bool = True,
                  required_keys: Sequence[str] = ()) -> List[Sample]:
    """Read an extxyz file into samples for ``config`` (missing label keys are skipped;
    ``charge_key``/``spin_multiplicity_key``: see :func:`petfunc.data.sample_from_atoms`).
    A file without any of the labels is an error unless ``require_labels`` is false
    (its samples then have NaN labels). ``required_keys``: label keys the user named,
    which no structure having is an error (a typo must not drop a row of errors)."""
    frames = read_frames(path, "dataset")
    check_info_keys(frames, {"charge_key": charge_key, "spin_multiplicity_key": spin_multiplicity_key}, path, "")
    missing = [key for key in required_keys if key and not any(_has_key(a, key) for a in frames)]
    if missing:
        raise ValueError(f"{str(path)!r}: no structure has labels under the key(s) {missing} "
                         f"(keys in the file: {_available_keys(frames)})")

    def key_or_none(key):
        return key if key and any(_has_key(a, key) for a in frames) else None

    labels = Labels(
        key_or_none(energy_key), key_or_none(forces_key), key_or_none(stress_key), key_or_none(virial_key),
        energy_unit_factor(energy_unit), length_unit_factor(length_unit), charge_key, spin_multiplicity_key,
    )
    unlabelled = labels.energy is None and labels.forces is None and labels.stress is None and labels.virial is None
    if unlabelled and require_labels:
        raise ValueError(
            f"{str(path)!r} has no labels under the keys {energy_key!r}, {forces_key!r}, {stress_key!r} "
            f"(keys in the file: {_available_keys(frames)}); to write predictions alone, give an output file"
        )
    return to_samples(frames, config, labels, path)


# ---------------------------------------------------------------------------------------
# the files of a training run


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
    train_labels: List[Labels]
    val_labels: List[Labels]
    weights: LossWeights
    split: dict
    test_parts: list = field(default_factory=list)
    test_labels: List[Labels] = field(default_factory=list)

    @property
    def atomic_types(self) -> List[int]:
        """Every atomic number in the training and validation structures, sorted: the
        model's types, as in metatrain (the test set must not change the model)."""
        return _types_of(self.train_parts + self.val_parts)

    @property
    def validation_only_types(self) -> List[int]:
        """Atomic numbers found in the validation structures and in no training one."""
        return sorted(set(_types_of(self.val_parts)) - set(_types_of(self.train_parts)))

    @property
    def train_sizes(self) -> List[int]:
        """Training structures per file, in the order of :meth:`samples`."""
        return [len(part[0]) for part in self.train_parts]

    @property
    def val_sizes(self) -> List[int]:
        """Validation structures per file, in the order of :meth:`samples`."""
        return [len(part[0]) for part in self.val_parts]

    def samples(self, config: PETConfig) -> Tuple[List[Sample], List[Sample]]:
        """``(training, validation)`` samples for ``config``; errors name each
        structure by its index in its file."""
        return (_samples(self.train_parts, self.train_labels, config),
                _samples(self.val_parts, self.val_labels, config))

    def test_samples(self, config: PETConfig) -> List[Sample]:
        """The test set's samples for ``config`` (empty without ``test_set``); a type
        the model lacks is an error before training (metatrain fails after it)."""
        unknown = sorted(set(_types_of(self.test_parts)) - set(config.atomic_types))
        if unknown:
            raise ValueError(
                f"the test set has atomic type(s) {unknown} that the model lacks (it has "
                f"{list(config.atomic_types)}, from the training and validation sets): it cannot predict "
                "their structures; move some to the training set, or leave them out of the test set")
        return _samples(self.test_parts, self.test_labels, config)


def _types_of(parts) -> List[int]:
    return sorted({int(z) for part in parts for a in part[0] for z in a.numbers})


def _samples(parts, labels, config: PETConfig) -> List[Sample]:
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
        raise ValueError(f"option '{where}': index {int(indices.max())} is out of range for a file of {n} structures")
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


def read_training_files(options: Mapping, weights: LossWeights, explicit: set, seed: int,
                        ckpt: Optional[Mapping] = None, log: Callable[[str], None] = print) -> TrainingFiles:
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
        require_complete_labels(frames, label_keys(frames, section, weights, set(), option), path, where=option)
        return frames

    def read_files(sections, name):
        return [read_file(section, where(name, i)) for i, section in enumerate(sections or [])]

    files = read_files(train_sections, "training_set")
    val_files = [_subset(f, sec, f"validation_set[{i}]" if many else "validation_set")
                 for i, (f, sec) in enumerate(zip(read_files(val_sections, "validation_set"), val_sections or []))]
    test_files = [_subset(f, sec, f"test_set[{i}]" if many else "test_set")
                  for i, (f, sec) in enumerate(zip(read_files(test_sections, "test_set"), test_sections or []))]
    sizes = [len(f) for f in files]
    # metatrain's explicit indices: a training file's structures, before any split
    chosen = [_checked_indices(section.get("indices"), len(f), where("training_set", i) + ".indices")
              for i, (f, section) in enumerate(zip(files, train_sections))]
    explicit_indices = any(section.get("indices") is not None for section in train_sections) \
        or indices_only(val_option) or indices_only(test_option)
    if ckpt is not None:  # a restart trains on the structures of the run it continues
        _check_split_options(options, ckpt)
        splits = restart_split(ckpt, sizes, None if val_sections else val_fraction, seed,
                               partition=not explicit_indices)
    else:
        # a separate file or indices-only set draws nothing (metatrain shuffles then not)
        splits = split_datasets([len(c) for c in chosen],
                                None if val_sections or indices_only(val_option) else val_fraction, seed,
                                None if test_sections or indices_only(test_option) else test_fraction)
        # positions in the chosen structures -> indices in the file
        splits = [tuple(c[part] for part in parts) for c, parts in zip(chosen, splits)]
        for name, option, k in (("validation_set", val_option, 1), ("test_set", test_option, 2)):
            if indices_only(option):  # as metatrain: taken from the whole file, training kept as it is
                idx = _checked_indices(option["indices"], sizes[0], f"{name}.indices")
                train = splits[0][0]
                overlap = np.intersect1d(train, idx)
                if len(overlap):
                    log(f"warning: {name}.indices and the training structures share {len(overlap)} structure(s) "
                        f"(for example {overlap[:5].tolist()}); metatrain does not remove them from training either")
                parts = list(splits[0])
                parts[k] = idx
                splits[0] = tuple(parts)
    # (frames, section, file indices, option name) of every training, validation and test part
    train_parts, val_parts, test_parts = [], [], []
    for i, (frames, section, (train_idx, val_idx, test_idx)) in enumerate(zip(files, train_sections, splits)):
        train_parts.append(([frames[j] for j in train_idx], section, train_idx, where("training_set", i)))
        for name, option, sections, idx, parts in (("validation_set", val_option, val_sections, val_idx, val_parts),
                                                   ("test_set", test_option, test_sections, test_idx, test_parts)):
            if sections is not None:
                continue
            use = "validation" if name == "validation_set" else "testing"
            fraction = option if isinstance(option, (int, float)) else 0.0
            if fraction > 0 and not len(idx) and ckpt is None:
                log(f"warning: {name} {fraction:g} of the {len(frames)} structures of "
                    f"{section['systems']['read_from']} is less than one; none of them is used for {use}")
            elif fraction > 0 and not len(idx):
                log(f"warning: the split of the restarted run uses none of the structures of "
                    f"{section['systems']['read_from']} for {use}; {name} {fraction:g} is ignored")
            if len(idx):
                parts.append(([frames[j] for j in idx], section, idx, where(name, i)))
    for name, sections, separate, parts in (("validation_set", val_sections, val_files, val_parts),
                                            ("test_set", test_sections, test_files, test_parts)):
        for i, (frames, section) in enumerate(zip(separate, sections or [])):
            parts.append((frames, section, None, where(name, i)))
    # file indices of every part, stored in checkpoints for restarts
    split_json = {name: [[int(j) for j in split[k]] for split in splits]
                  for k, name in enumerate(("training", "validation", "test"))}
    # and a digest of each training file's content: a restart says when a file changed
    # (the indices only catch another number of structures)
    # (separate validation and test files too: they pick the best epoch)
    changed = []
    for key, name, frames_of in (("digests", "training_set", files), ("validation_digests", "validation_set", val_files),
                                 ("test_digests", "test_set", test_files)):
        split_json[key] = [content_digest(frames) for frames in frames_of]
        stored = (ckpt.get("split") or {}).get(key) if ckpt is not None else None
        if stored is not None:
            changed += [where(name, i) for i, (a, b) in enumerate(zip(stored, split_json[key])) if a != b]
    if changed:
        log(f"warning: {', '.join(changed)} changed since the checkpoint (the same number of structures, other "
            "positions, cells, species or labels): the restart uses the files as they are now")

    # labels: a loss term the options ask for must have labels in some training file;
    # structures of files without them get NaN labels, which the loss skips
    train_labels = [label_keys(f, sec, weights, explicit if not many else set(), w) for f, sec, _, w in train_parts]
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
            log(f"no {term} labels in the training files (looked for {', '.join(map(repr, sorted(sought)))}): "
                f"training without the {term} term")
    weights = dataclasses.replace(
        weights,
        forces=weights.forces if has["forces"] else LossTerm(0.0, weights.forces.type),
        stress=weights.stress if (has["stress"] or has["virial"]) else LossTerm(0.0, weights.stress.type),
    )

    return TrainingFiles(train_parts, val_parts, train_labels, val_labels, weights, split_json,
                         test_parts, test_labels)
