"""The composition and scaler checkpoints metatrain's training options can name."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from petfunc._files import PathLike
from petfunc.io.formats import is_torchscript
from petfunc.io.metatrain.unpickle import read_bytes, require_metatrain, unpickle_checkpoint
from petfunc.units import energy_unit_factor


def read_metatrain_baseline(
    path: PathLike,
    kind: str,
    atomic_types,
    unit: str,
    additive_models: tuple[str, ...] = ("CompositionModel",),
) -> np.ndarray:
    """Energy weights of a metatrain ``composition`` or ``scaler`` model checkpoint.

    These are what metatrain's ``atomic_baseline: path`` and ``fixed_scaling_weights:
    path`` options load (checkpoints of ``mtt train`` with ``architecture.name:
    composition`` or ``scaler``). The checks are metatrain's: the model kind, the
    atomic types (equal, in order) and the targets (exactly ``energy``, an energy).

    Args:
        kind: ``"composition"`` or ``"scaler"``.
        atomic_types: of the PET being trained.
        unit: the energy unit of the training data (petfunc's name, e.g. ``"eV"``).
            A checkpoint trained on data of another unit is an error; one that
            names no unit (metatrain's default) is taken to share the data's.
        additive_models: class names of metatrain's additive models of the PET
            being trained (``CompositionModel``, then ``ZBL`` with ``zbl``): a scaler
            must have been fitted after subtracting the same ones (metatrain's check).
    Returns:
        float64, in eV: ``[n_types]`` per-type energies (composition), or the energy
        scale as a 0-d array (scaler).
    """

    if kind not in ("composition", "scaler"):
        raise ValueError(f"kind must be 'composition' or 'scaler', got {kind!r}")
    # a missing file is named as such, with or without metatrain installed
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {kind} checkpoint at {str(path)!r}")
    label = f"the {kind} checkpoint {str(path)!r}"
    model = _baseline_model(path, kind, label)
    factor = _checked_unit_factor(model, kind, label, atomic_types, unit, additive_models)
    return _energies(model, kind, label, atomic_types, factor)


def _baseline_model(path, kind: str, label: str):
    """The metatrain model of a composition or scaler checkpoint, read without running
    a pickle: the file is unpickled by :func:`unpickle_checkpoint` (metatrain's own
    ``load_model`` would fall back to a full unpickling) and the model is built from
    the checkpoint's data by metatrain."""
    require_metatrain()
    from metatrain.composition import CompositionModel
    from metatrain.scaler import Scaler
    from metatrain.utils.io import model_from_checkpoint

    classes = {"composition": CompositionModel, "scaler": Scaler}
    data = read_bytes(Path(path))
    if is_torchscript(data):  # metatrain itself refuses an export here: it is no CompositionModel
        raise ValueError(
            f"{label} is an exported model; {kind} options take the checkpoint (.ckpt) of "
            f"`mtt train` with architecture.name: {kind}"
        )
    checkpoint = unpickle_checkpoint(data, label)
    try:
        model = model_from_checkpoint(checkpoint, context="export")
    except Exception as error:  # metatrain's own message names what it could not read
        raise ValueError(f"{label} could not be read by metatrain: {error}") from error
    if not isinstance(model, classes[kind]):
        raise ValueError(f"{label} holds a {type(model).__name__}, not a metatrain {classes[kind].__name__}")
    return model


def _checked_unit_factor(model, kind: str, label: str, atomic_types, unit: str, additive_models) -> float:
    """metatrain's checks of a baseline model against the PET being trained; returns
    eV per energy unit of the training data."""
    if [int(t) for t in model.atomic_types] != [int(t) for t in atomic_types]:
        raise ValueError(
            f"{label} has atomic types {list(model.atomic_types)}, the model "
            f"{list(atomic_types)}: they must be equal"
        )
    targets = model.dataset_info.targets
    if set(targets) != {"energy"}:
        raise ValueError(f"{label} has targets {sorted(targets)}; petfunc trains the target 'energy' only")
    info = targets["energy"]
    if info.quantity not in ("energy", ""):
        raise ValueError(f"{label}: its target 'energy' is a {info.quantity!r}, not an energy")
    factor = energy_unit_factor(unit)
    if info.unit and energy_unit_factor(info.unit) != factor:
        raise ValueError(
            f"{label} was fitted on energies in {info.unit!r}, the training data are in {unit!r}"
        )
    if kind == "scaler":
        trained = list(getattr(model, "training_additive_models", []))
        if trained != list(additive_models):
            raise ValueError(
                f"{label} was fitted after subtracting the additive models {trained}, but this PET "
                f"has {list(additive_models)}: fit the scaler with the composition checkpoint as an "
                "additive model (metatrain's scaler option additive_models)"
            )
    return factor


def _energies(model, kind: str, label: str, atomic_types, factor: float) -> np.ndarray:
    """The model's per-type energies or its energy scale, in eV."""
    import metatensor.torch as mts

    state = model.state_dict()
    key = "energy_composition_buffer" if kind == "composition" else "energy_scaler_buffer"
    if key not in state:
        raise ValueError(f"{label} has no buffer {key!r}")
    block = mts.load_buffer(state[key]).block()
    values = block.values.detach().to(torch.float64).reshape(-1)
    if kind == "scaler":
        if values.numel() != 1:
            raise ValueError(f"{label} holds {values.numel()} energy scales; petfunc supports one")
        return np.asarray(float(values[0]) * factor)
    column = block.samples.names.index("center_type")
    by_type = {int(sample[column]): float(values[n]) for n, sample in enumerate(block.samples.values)}
    return np.array([by_type.get(int(t), 0.0) * factor for t in atomic_types])
