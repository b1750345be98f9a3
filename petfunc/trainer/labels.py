"""The label keys and units of a run's dataset files, and the loss terms they leave.

:func:`label_keys` chooses the keys of one file's energies, forces, stresses or
virials (and the info keys of charge and spin) from its dataset section;
:func:`training_labels` does so for every part of the run and drops the loss terms
that no training file has labels for; :func:`unit_notes` says where the data's
units make the model differ from metatrain's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from petfunc.config import PETConfig
from petfunc.data import Labels, available_keys, has_key
from petfunc.train import LossTerm, LossWeights
from petfunc.trainer.options import dataset_sections
from petfunc.trainer.options.datasets import GRADIENTS
from petfunc.units import energy_unit_factor, length_unit_factor


def training_labels(
    parts: tuple[list, list, list],
    weights: LossWeights,
    explicit: set,
    many: bool,
    log: Callable[[str], None],
) -> tuple[tuple[list[Labels], list[Labels], list[Labels]], LossWeights]:
    """``((train, validation, test labels), weights)`` of the ``(frames, section,
    indices, option name)`` parts of a run (``many``: several training files).

    A loss term the options ask for (``explicit``) must have labels in some training
    file; structures of files without them get NaN labels, which the loss skips.
    Terms without any training labels are dropped from ``weights`` (no derivative is
    computed for them), with a log line as metatrain's "No forces found"."""
    train_parts, val_parts, test_parts = parts
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
                f"no {term} labels in the training files "
                f"(looked for {', '.join(map(repr, sorted(sought)))}): training without the {term} term"
            )
    weights = dataclasses.replace(
        weights,
        forces=weights.forces if has["forces"] else LossTerm(0.0, weights.forces.type),
        stress=weights.stress if (has["stress"] or has["virial"]) else LossTerm(0.0, weights.stress.type),
    )
    for message in unused_labels(train_parts, train_labels, weights):
        log(message)
    return (train_labels, val_labels, test_labels), weights


def unused_labels(train_parts: list, train_labels: list[Labels], weights: LossWeights) -> list[str]:
    """One warning per kind of label (forces, stress, virial) that a training file
    holds under its default key or the key its section names, but that the loss
    leaves out: the section's entry is off (``false``, or unset for a target not
    named ``energy``, as in metatrain) or the loss weight of its term is 0. A
    misnamed target or a forgotten entry would otherwise train on energies alone.

    ``train_parts`` are the ``(frames, section, indices, option name)`` of the
    training files, ``train_labels`` the keys read from each, ``weights`` the loss
    with the terms no training file has labels for dropped."""
    messages = {}
    for (frames, section, _, where), labels in zip(train_parts, train_labels):
        target = section["targets"]["energy"]
        path = section["systems"]["read_from"]
        stress_read = bool(labels.stress or labels.virial)
        for name in GRADIENTS:
            if name in messages:
                continue
            spec = target[name]
            key = spec["key"] if isinstance(spec, dict) else name
            count = sum(has_key(a, key) for a in frames)
            if not count:
                continue
            term = "forces" if name == "forces" else "stress"
            read = getattr(labels, name) is not None
            found = f"{where}: {count} of the {len(frames)} training structures of {path!r} have {name}"
            if read and getattr(weights, term).weight == 0:
                messages[name] = (
                    f"warning: {found} labels (key {key!r}), but the loss weight of the {term} term is 0: "
                    f"they are not trained on. Give 'architecture.training.loss.energy.{term}' a weight > 0 "
                    "to train on them"
                )
            elif not read and spec is False and not (name != "forces" and stress_read):
                # a stress entry left off beside a virial that is read (or the other
                # way round) is the choice of one of two labels of the same quantity
                messages[name] = (
                    f"warning: {found} labels (key {key!r}), but the loss leaves them out: the energy "
                    f"target's '{name}' entry in '{where}.targets' is off (false, or unset for a "
                    f"target not named 'energy'). Set '{name}: true' (or {{key: K}}) there to train "
                    "on them"
                )
    return list(messages.values())


def label_keys(frames, section: Mapping, weights: LossWeights, explicit: set, where: str) -> Labels:
    """Which keys of ``frames`` (a file of dataset ``section``, option ``where``) to
    read for the loss terms of ``weights``; raises when labels the section or the
    ``explicit`` loss terms ask for are missing from the file."""
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


def unit_notes(options: Mapping, log: Callable[[str], None]) -> None:
    """Say where the data's units make petfunc's model differ from metatrain's: lengths
    not in Å (petfunc converts them and keeps the architecture's lengths in Å, where
    metatrain trains in the data's unit: its ``cutoff: 4.0`` on data in bohr is 4
    bohr), and ``zbl`` with energies not in eV (metatrain adds no ZBL term then)."""
    # the dataset sections written out (a fraction or indices have none)
    sections = {
        name: dataset_sections(options[name])
        for name in ("training_set", "validation_set", "test_set")
        if isinstance(options.get(name), (dict, list))
    }
    units = {
        str(s["systems"].get("length_unit") or "angstrom")
        for part in sections.values()
        for s in part
        if "systems" in s
    }
    other = sorted(u for u in units if length_unit_factor(u) != 1.0)
    if other:
        model = options["architecture"]["model"]
        log(
            f"note: lengths in {', '.join(other)} are converted to Å on reading; the model's lengths "
            f"(cutoff {model.get('cutoff', PETConfig.cutoff):g}, cutoff_width "
            f"{model.get('cutoff_width', PETConfig.cutoff_width):g}) are in Å "
            "and forces are compared in eV/Å. metatrain instead trains in the data's length unit "
            f"(there these cutoffs would be in {other[0]}): the same options give a different model"
        )
    energies = {
        str(s["targets"]["energy"].get("unit") or "eV")
        for name in ("training_set", "validation_set")
        for s in sections.get(name, ())
        if "targets" in s
    }
    if options["architecture"]["model"].get("zbl") and energies - {"eV"}:
        log(
            f"note: energies in {', '.join(sorted(energies - {'eV'}))} are converted to eV on reading, "
            "and the model adds the ZBL repulsion in eV; metatrain's model of such data has no ZBL term "
            "(it applies ZBL to a target in eV only): the same options give a different model"
        )
