"""Reading labelled structure files (extxyz, or any format ASE reads).

:func:`read_frames` reads a file with errors that name it; :class:`Labels` says
which keys of ``atoms.info``, ``atoms.arrays`` or the attached calculator hold the
energy, forces, stress or virial, and their units; :func:`to_samples` turns frames
into :class:`~petfunc.data.Sample` objects, naming each structure that has bad
data; :func:`read_labelled` does all of it for one file.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import ase.io
import numpy as np

from petfunc.config import PETConfig
from petfunc.data.samples import Sample, sample_from_atoms
from petfunc.units import energy_unit_factor, length_unit_factor


def read_frames(path, where: str, index=":") -> list:
    """The structures of an ASE-readable file (``index`` as for ``ase.io.read``);
    errors start with ``where`` (the option or role of the file) and name it."""
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"{where}: dataset file not found: {str(path)!r}")
    if not path.is_file():
        raise ValueError(f"{where}: {str(path)!r} is not a file")
    try:
        frames = ase.io.read(str(path), index=index)
    except Exception as error:  # noqa: BLE001 - ASE raises many kinds of errors on bad files
        raise ValueError(
            f"{where}: could not read dataset file {str(path)!r}: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(frames, list):
        frames = [frames]
    if not frames:
        raise ValueError(f"{where}: dataset file {str(path)!r} holds no structures")
    return frames


def has_key(atoms, key) -> bool:
    if key in atoms.info or key in atoms.arrays:
        return True
    calc = atoms.calc
    return calc is not None and key in getattr(calc, "results", {})


def available_keys(frames) -> list[str]:
    keys = set()
    for atoms in frames[:50]:
        keys.update(atoms.info)
        keys.update(k for k in atoms.arrays if k not in ("numbers", "positions"))
        if atoms.calc is not None:
            keys.update(getattr(atoms.calc, "results", {}))
    return sorted(keys)


@dataclass
class Labels:
    energy: str | None
    forces: str | None
    stress: str | None
    virial: str | None
    energy_unit: float
    length_unit: float
    charge: str | None = None  # atoms.info keys for system conditioning (None: defaults)
    spin_multiplicity: str | None = None


def check_info_keys(frames, keys: Mapping, path, where: str) -> None:
    """Raise when a named ``atoms.info`` key (charge, spin multiplicity) is in no
    structure of the file: a misspelt key would otherwise give silent defaults."""
    for name, key in keys.items():
        if key is not None and not any(key in a.info for a in frames):
            raise ValueError(
                f"{where}{name}: no structure in {str(path)!r} has the info key {key!r} "
                f"(keys in the file: {available_keys(frames)})"
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
        lacking = [i for i, atoms in enumerate(frames) if not has_key(atoms, key)]
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


def to_samples(
    frames, config: PETConfig, labels: Labels, path, indices=None, for_loss: bool = False
) -> list[Sample]:
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
            atoms,
            config,
            labels.energy,
            labels.forces,
            labels.stress,
            labels.virial,
            labels.energy_unit,
            labels.length_unit,
            label=label,
            charge_key=labels.charge,
            spin_multiplicity_key=labels.spin_multiplicity,
        )
        for name in ("energy", "forces", "stress", "virial"):
            value = getattr(sample, name)
            if value is not None and np.isinf(np.asarray(value)).any():
                raise ValueError(f"{label}: the {name} label is infinite")
        stress = sample.stress
        if (
            for_loss
            and stress is not None
            and not np.isnan(stress).all()
            and np.linalg.det(sample.structure.cell) == 0.0
        ):
            no_volume.append((i, np.asarray(atoms.pbc).tolist()))
        samples.append(sample)
    if no_volume:
        shown = ", ".join(f"{i} (pbc={pbc})" for i, pbc in sorted(no_volume)[:10]) + (
            ", ..." if len(no_volume) > 10 else ""
        )
        many = len(no_volume) > 1
        raise ValueError(
            f"{path}: {len(no_volume)} structure{'s have' if many else ' has'} a stress label but no "
            f"cell volume: structure{'s' if many else ''} {shown}. A stress needs a cell periodic in all "
            f"three directions; write a NaN stress for {'them' if many else 'it'} (the loss skips NaN labels)"
        )
    return samples


def read_labelled(
    path,
    config: PETConfig,
    energy_key="energy",
    forces_key="forces",
    stress_key="stress",
    virial_key=None,
    energy_unit="eV",
    length_unit="angstrom",
    charge_key=None,
    spin_multiplicity_key=None,
    require_labels: bool = True,
    required_keys: Sequence[str] = (),
) -> list[Sample]:
    """Read an extxyz file into samples for ``config`` (missing label keys are skipped;
    ``charge_key``/``spin_multiplicity_key``: see :func:`petfunc.data.sample_from_atoms`).
    A file without any of the labels is an error unless ``require_labels`` is false
    (its samples then have NaN labels). ``required_keys``: label keys the user named,
    which no structure having is an error (a typo must not drop a row of errors)."""
    frames = read_frames(path, "dataset")
    check_info_keys(
        frames, {"charge_key": charge_key, "spin_multiplicity_key": spin_multiplicity_key}, path, ""
    )
    missing = [key for key in required_keys if key and not any(has_key(a, key) for a in frames)]
    if missing:
        raise ValueError(
            f"{str(path)!r}: no structure has labels under the key(s) {missing} "
            f"(keys in the file: {available_keys(frames)})"
        )

    def key_or_none(key):
        return key if key and any(has_key(a, key) for a in frames) else None

    labels = Labels(
        key_or_none(energy_key),
        key_or_none(forces_key),
        key_or_none(stress_key),
        key_or_none(virial_key),
        energy_unit_factor(energy_unit),
        length_unit_factor(length_unit),
        charge_key,
        spin_multiplicity_key,
    )
    unlabelled = (
        labels.energy is None and labels.forces is None and labels.stress is None and labels.virial is None
    )
    if unlabelled and require_labels:
        raise ValueError(
            f"{str(path)!r} has no labels under the keys {energy_key!r}, {forces_key!r}, {stress_key!r} "
            f"(keys in the file: {available_keys(frames)}); to write predictions alone, give an output file"
        )
    return to_samples(frames, config, labels, path)


# ---------------------------------------------------------------------------------------
# the files of a training run
