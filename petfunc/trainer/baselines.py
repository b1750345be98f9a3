"""The composition weights and the energy scale a run trains with: the restart
checkpoint's, the fine-tuning checkpoint's (as metatrain keeps those of a target
the model has), read from metatrain's composition and scaler checkpoints, given as
numbers, or fitted on the training set (metatrain's ``CompositionModel`` and
``Scaler``). Both are in eV and stored in the parameters, never trained."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.data import Sample, fit_composition, fit_scale
from petfunc.io import read_metatrain_baseline
from petfunc.trainer.models import target_params
from petfunc.trainer.options import dataset_sections, fixed_composition


def composition_and_scale(
    options: Mapping,
    ckpt: Mapping | None,
    config: PETConfig,
    params,
    train: Sequence[Sample],
    train_sizes: Sequence[int],
    per_atom: bool,
    dtype: torch.dtype,
    device,
    log: Callable[[str], None],
) -> tuple[np.ndarray, float]:
    """``(composition weights [num_species] float64, energy scale)`` of a run.

    A restart's are its checkpoint's ``ckpt``; a fine-tuning run keeps its
    checkpoint's (:func:`finetune_baseline`; ``params`` are the initial parameters,
    ``dtype`` and ``device`` the run's) unless files replace them; else they are
    fixed by the options or fitted on the ``train`` samples (``train_sizes``
    structures per file; ``per_atom``: the scale of energies per atom)."""
    if ckpt is not None:
        return np.asarray(ckpt["composition"]["weights"], dtype=np.float64), float(ckpt["energy_scale"])
    kept = finetune_baseline(options, dtype, device, params)
    if kept is not None:
        return _kept(options, config, kept, log)
    return _fitted(options, config, train, train_sizes, per_atom, log)


def _kept(options: Mapping, config: PETConfig, kept: tuple, log: Callable[[str], None]) -> tuple:
    """A fine-tuning run's weights: the checkpoint's ``kept`` ones, as metatrain's
    composition model and scaler keep those of a target the checkpoint already has
    (only new targets are fitted); a composition or scaler checkpoint file given in
    the options replaces them."""
    training = options["architecture"]["training"]
    baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
    from_file, scale_from_file = baseline_from_files(options, config)
    composition = kept[0] if from_file is None else from_file
    scale = kept[1] if scale_from_file is None else scale_from_file
    ignored = [
        name
        for name, value in (("atomic_baseline", baseline), ("fixed_scaling_weights", scaler))
        if value and "file" not in value
    ]
    log(
        "composition weights "
        + (f"from {baseline['file']}" if "file" in baseline else "of the fine-tuning checkpoint")
        + ", energy scale "
        + (f"from {scaler['file']}" if "file" in scaler else "of the fine-tuning checkpoint")
        + " (metatrain keeps a fitted target's)"
        + (f"; {' and '.join(ignored)} given as weights are not used, as in metatrain" if ignored else "")
    )
    return composition, scale


def _fitted(options: Mapping, config: PETConfig, train, train_sizes, per_atom: bool, log) -> tuple:
    """The weights of a run from scratch: fixed by the options (numbers or files) or
    fitted on the training samples, as metatrain fits them."""
    training = options["architecture"]["training"]
    baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
    fixed, scale_from_file = baseline_from_files(options, config)
    if fixed is not None:
        log(f"composition weights from {baseline['file']}")
    else:
        fixed = fixed_composition(baseline, config.atomic_types)
    if not any(s.energy is not None and np.isfinite(s.energy) for s in train):
        log(
            "warning: no training structure has a finite energy label: the composition weights are 0 and the "
            "energy scale 1 (nothing to fit them to)"
        )
    if fixed is None:
        # accumulated per batch of each file in turn, as metatrain's loaders do
        composition = fit_composition(
            train, config.num_species, training["batch_size"], config, dataset_sizes=train_sizes
        )
    else:
        composition = fixed
    # the scale is fitted only where no fixed one replaces it (the fit evaluates
    # ZBL on every structure, and may warn of a residual at round-off)
    if scale_from_file is not None:
        scale = scale_from_file
        log(f"energy scale from {scaler['file']}")
    elif "energy" in scaler:
        scale = scaler["energy"]
    elif training["scale_targets"]:
        scale = fit_scale(train, composition, config, per_atom=per_atom)
    if not training["scale_targets"]:  # as in metatrain, this wins over a fixed scale
        scale = 1.0
    return composition, scale


def baseline_file(path, kind, atomic_types, unit, additive_models=("CompositionModel",)):
    """:func:`petfunc.io.read_metatrain_baseline`, with a missing metatrain an options error."""
    try:
        return read_metatrain_baseline(path, kind, atomic_types, unit, additive_models)
    except ImportError as error:
        option = "atomic_baseline" if kind == "composition" else "fixed_scaling_weights"
        raise ValueError(
            f"option 'architecture.training.{option}' names a metatrain {kind} checkpoint: {error}"
        ) from None


def baseline_from_files(options, config: PETConfig):
    """``(composition weights, energy scale)`` read from metatrain's composition and
    scaler checkpoints named by ``atomic_baseline: {file}`` and
    ``fixed_scaling_weights: {file}``; each ``None`` when not given. Such files were
    fitted on data in one energy unit, so the training files must share it."""
    training = options["architecture"]["training"]
    baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
    if "file" not in baseline and "file" not in scaler:
        return None, None
    units = {section["targets"]["energy"]["unit"] for section in dataset_sections(options["training_set"])}
    if len(units) > 1:
        raise ValueError(
            f"the training files have energies in several units ({sorted(units)}); "
            "a composition or scaler checkpoint needs one"
        )
    (unit,) = units
    composition = scale = None
    if "file" in baseline:
        composition = baseline_file(baseline["file"], "composition", config.atomic_types, unit)
    if "file" in scaler:
        additive = ("CompositionModel",) + (("ZBL",) if config.zbl else ())
        scale = float(baseline_file(scaler["file"], "scaler", config.atomic_types, unit, additive))
    return composition, scale


def finetune_baseline(options, dtype, device, params):
    """``(composition weights, energy scale)`` a fine-tuning run keeps from its
    checkpoint, or ``None`` (no fine-tuning, or a target the checkpoint lacks).

    metatrain fits the composition and the scale only for targets that are new to
    the model: those of the trained target (``energy``, or the dataset's
    ``mtt::NAME``) are kept when the checkpoint has that target, whichever target
    ``inherit_heads`` takes the heads from; otherwise they are fitted."""
    finetune = options["architecture"]["training"]["finetune"]
    path = finetune.get("read_from")
    if not path:
        return None
    name = finetune.get("target_name", "energy")
    source = (finetune.get("inherit_heads") or {}).get("energy")
    if source is None or source == name:
        weights_of = (
            params  # read from the trained target itself (see petfunc.trainer.models.finetuned_model)
        )
    else:
        weights_of = target_params(path, name, dtype, device)
        if weights_of is None:
            return None
    return (
        weights_of["composition_weights"].detach().to("cpu", torch.float64).numpy().copy(),
        float(weights_of["energy_scale"]),
    )
