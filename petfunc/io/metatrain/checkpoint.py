"""Reading metatrain's PET checkpoints and exported models without running their pickles.

:func:`from_metatrain` reads a metatrain PET checkpoint (``.ckpt`` or ``.ckpt.gz``,
model versions 1 to 16), an LLPR checkpoint wrapping one, or an exported metatomic
``model.pt`` into ``(config, params)``. This needs the optional ``metatrain`` extra.
A checkpoint loads with ``torch.load(weights_only=True)``, allowing only the objects
metatrain checkpoints hold (its dataset and target descriptions, metatensor layouts),
so reading one runs no pickled code; ``PETFUNC_TRUST_CHECKPOINTS=1`` allows other
objects in a file you trust.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from petfunc import lora, tree
from petfunc._files import PathLike
from petfunc.config import PETConfig
from petfunc.io.formats import is_torchscript
from petfunc.io.metatrain.convert import (
    assemble_params,
    choose_target,
    composition_and_scale,
    config_from_hypers,
    in_angstrom_and_ev,
    merge_lora,
    network_params,
    split_lora,
    zbl_as_metatrain,
)
from petfunc.io.metatrain.exported import from_exported
from petfunc.io.metatrain.llpr import llpr_wrapped_checkpoint, uncertainty_of
from petfunc.io.metatrain.unpickle import (
    copy_checkpoint,
    read_bytes,
    require_metatrain,
    unpickle_checkpoint,
)
from petfunc.model import TARGET


def from_metatrain(
    source: PathLike | Mapping[str, Any],
    dtype: torch.dtype | None = None,
    target: str | None = None,
) -> tuple[PETConfig, Any]:
    """Config and parameters of a metatrain PET.

    Args:
        source: a checkpoint path (``.ckpt``, or gzip-compressed ``.ckpt.gz``), a
            checkpoint dict as returned by ``torch.load`` (not modified), or the path
            of an exported metatomic model (``model.pt``).
        dtype: dtype of the network weights (default: the checkpoint's). The
            composition weights and the energy scale stay float64.
        target: which energy target to read (default: ``"energy"``, or the only
            target whose quantity is energy).

    An LLPR uncertainty checkpoint (``architecture_name: llpr``, as PET-MAD's are)
    gives the PET it wraps (see :mod:`petfunc.llpr` for its uncertainties).
    Checkpoints of every PET model version (1 to 16) are upgraded with metatrain's
    own ``PET.upgrade_checkpoint``. As metatrain's ``"export"`` context does, this
    reads ``best_model_state_dict`` (``model_state_dict`` if that is missing), and
    merges LoRA finetuning weights into the plain weights. A model trained in other
    units than Å and eV is converted to them (see :func:`in_angstrom_and_ev`).

    Raises:
        ImportError: metatrain is not installed (``pip install 'petfunc[metatrain]'``).
        ValueError: not a PET checkpoint, weights that do not fit the hypers, or a
            checkpoint holding pickled objects other than metatrain's own (named in the
            message; ``PETFUNC_TRUST_CHECKPOINTS=1`` loads them from a file you trust).
    """
    config, params, _ = read_metatrain(source, dtype, target)
    return config, params


def read_metatrain(
    source,
    dtype=None,
    target=None,
    llpr: str | None = None,
    lora_out: dict | None = None,
    which: str = "best",
):
    """``(config, params, uncertainty)`` of a metatrain checkpoint or exported model,
    read once. ``llpr``: ``None`` (``uncertainty`` is ``None``), ``"if present"``
    (an LLPR checkpoint's uncertainty quantities, see :mod:`petfunc.llpr`) or
    ``"required"`` (anything else is an error).

    LoRA adapters of a checkpoint fine-tuned with ``method: lora`` are merged into
    the weights, unless ``lora_out`` is a dict: the adapters then stay apart, in
    ``params["lora"]`` (:mod:`petfunc.lora`'s layout), and ``lora_out`` receives the
    source's ``{"rank", "alpha", "targets"}``. ``which``: ``"best"`` reads a
    checkpoint's ``best_model_state_dict`` (as metatrain's export), ``"last"`` its
    ``model_state_dict``; an exported model has only one set of weights."""
    metatrain_pet = require_metatrain()
    if isinstance(source, Mapping):
        label = "the checkpoint"
        checkpoint = copy_checkpoint(source)
    else:
        label = repr(str(source))
        data = read_bytes(Path(source))
        if is_torchscript(data):
            if llpr == "required":
                raise ValueError(f"{label} is an exported model, not an LLPR checkpoint")
            if which != "best":
                raise ValueError(
                    f"{label} is an exported model, with one set of weights: there is no "
                    f"{which!r} one to choose (the training checkpoint has both)"
                )
            return (*from_exported(data, dtype, target, label), None)
        checkpoint = unpickle_checkpoint(data, label)
        if not isinstance(checkpoint, dict):
            raise ValueError(f"{label} is not a metatrain checkpoint (a {type(checkpoint).__name__})")

    checkpoint, wrapper = _pet_checkpoint(checkpoint, label, llpr == "required", metatrain_pet)
    model_data = checkpoint["model_data"]
    dataset_info = model_data["dataset_info"]
    config = config_from_hypers(model_data["model_hypers"], dataset_info.atomic_types, label)
    target = choose_target(dataset_info, target)
    state, adapters, lora_config = _weights(checkpoint, which, label, keep_adapters=lora_out is not None)
    network = network_params(state, target)
    weights, scale = composition_and_scale(state, target, config.atomic_types)
    params = assemble_params(config, network, weights, scale, dtype, label)
    if adapters:
        adapters = network_params(adapters, target)
        params[lora.KEY] = _adapters(params, adapters)
        lora_out.update(
            rank=int(next(v for k, v in adapters.items() if k.endswith(".lora_A.weight")).shape[0]),
            alpha=lora_config["alpha"],
            targets=tuple(lora_config.get("target_modules", lora.DEFAULT_TARGETS)),
        )
    uncertainty = None
    if llpr is not None and wrapper is not None:
        uncertainty = uncertainty_of(wrapper, config, params, dtype, target, label)
    energy_unit = str(getattr(dataset_info.targets[target], "unit", "") or "")
    return in_angstrom_and_ev(
        zbl_as_metatrain(config, energy_unit),
        params,
        str(dataset_info.length_unit or ""),
        energy_unit,
        label,
        uncertainty,
    )


def _pet_checkpoint(
    checkpoint: dict, label: str, llpr_required: bool, metatrain_pet
) -> tuple[dict, dict | None]:
    """``(PET checkpoint at metatrain's latest version, LLPR wrapper or None)``: an LLPR
    checkpoint is unwrapped, an older PET checkpoint upgraded by metatrain; anything
    else is refused with what it is."""
    name = checkpoint.get("architecture_name")
    if llpr_required and name != "llpr":
        raise ValueError(
            f"{label} is not an LLPR checkpoint (architecture_name={name!r}); "
            "petfunc.from_metatrain reads plain PET checkpoints"
        )
    wrapper = None
    if name == "llpr":
        wrapper = checkpoint
        checkpoint = llpr_wrapped_checkpoint(checkpoint, label)
        name = checkpoint.get("architecture_name")
    if name != "pet":
        if str(checkpoint.get("format", "")).startswith("petfunc."):
            raise ValueError(
                f"{label} is a petfunc file ({checkpoint['format']}), not a metatrain checkpoint: "
                "read it with petfunc.load_model(path) or PETCalculator.from_checkpoint(path)"
            )
        raise ValueError(f"{label} is not a PET checkpoint (architecture_name={name!r})")
    version = checkpoint.get("model_ckpt_version") or 1
    latest = metatrain_pet.__checkpoint_version__
    if version > latest:
        raise ValueError(
            f"{label} has PET model version {version}; the installed metatrain reads up "
            f"to version {latest}: upgrade metatrain"
        )
    checkpoint["model_ckpt_version"] = version
    if version < latest:
        checkpoint = metatrain_pet.upgrade_checkpoint(checkpoint)
    return checkpoint, wrapper


def _weights(checkpoint: Mapping, which: str, label: str, keep_adapters: bool):
    """``(state dict, LoRA adapters, LoRA config)`` of the ``which`` weights: LoRA
    adapters of a ``method: lora`` fine-tuning merged into the weights, or kept apart
    (``keep_adapters``)."""
    latest_state = checkpoint.get("model_state_dict") or {}
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    state = dict(latest_state if which == "last" else checkpoint.get("best_model_state_dict") or latest_state)
    if not state:
        raise ValueError(f"{label} holds no model weights (no model_state_dict)")
    finetune = state.pop("finetune_config", None) or latest_state.get("finetune_config") or {}
    adapters, lora_config = {}, {}
    if finetune.get("method") == "lora":
        lora_config = dict(finetune.get("config") or {})
        alpha = lora_config["alpha"] = float(lora_config.get("alpha", 8))  # metatrain's default
        if keep_adapters:
            state, adapters = split_lora(state)
        else:
            state = merge_lora(state, lambda prefix, rank: alpha / rank)
    elif any(k.endswith(".lora_A.weight") for k in state):
        raise ValueError(f"{label} has LoRA weights but its finetune_config is not 'lora'")
    return state, adapters, lora_config


def _adapters(params, adapters: Mapping):
    """LoRA adapters (named as by :func:`network_params`) in petfunc's layout
    (:mod:`petfunc.lora`), in the dtype of the weights they adapt."""
    reference = tree.flatten(params)
    return tree.unflatten(
        {
            k: v.detach().to(dtype=reference[k.rsplit(".lora_", 1)[0] + ".weight"].dtype)
            for k, v in adapters.items()
        }
    )


def is_llpr_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a metatrain LLPR checkpoint (``architecture_name: llpr``);
    ``False`` for anything else, unreadable files and without metatrain installed."""
    try:
        data = read_bytes(Path(path))
        if is_torchscript(data):
            return False
        require_metatrain()
        checkpoint = unpickle_checkpoint(data, repr(str(path)))
    except (ImportError, OSError, ValueError):
        return False
    return isinstance(checkpoint, Mapping) and checkpoint.get("architecture_name") == "llpr"


def metatrain_units(source: PathLike, target: str | None = None) -> tuple[str, str]:
    """``(length unit, energy unit)`` of the data a metatrain checkpoint or exported
    model was trained on (metatomic's names; ``""`` where it names none)."""
    label = repr(str(source))
    data = read_bytes(Path(source))
    if is_torchscript(data):
        require_metatrain()  # registers metatomic's TorchScript classes
        capabilities = torch.jit.load(io.BytesIO(data), map_location="cpu").capabilities()
        outputs = dict(capabilities.outputs)
        name = target or (TARGET if TARGET in outputs else None)
        if name not in outputs:
            raise ValueError(f"{label}: cannot pick the energy target among {sorted(outputs)}")
        return str(capabilities.length_unit or ""), str(outputs[name].unit or "")
    checkpoint = unpickle_checkpoint(data, label)
    if checkpoint.get("architecture_name") == "llpr":
        checkpoint = llpr_wrapped_checkpoint(checkpoint, label)
    info = checkpoint["model_data"]["dataset_info"]
    name = choose_target(info, target)
    return str(info.length_unit or ""), str(getattr(info.targets[name], "unit", "") or "")
