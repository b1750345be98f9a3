"""Loading a model from any file petfunc reads: :func:`load_model`.

One entry point for every kind of model file: a ``petfunc train`` checkpoint
(:mod:`petfunc.io.checkpoint`), a parameter file (:func:`petfunc.io.save_params`),
and, with metatrain installed, a metatrain checkpoint or exported model
(:mod:`petfunc.io.metatrain`). Every file is read with
``torch.load(weights_only=True)`` (metatrain's with only its own objects allowed),
so loading runs no pickled code.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from petfunc import lora, tree
from petfunc._files import not_a_file
from petfunc.io.checkpoint import CHECKPOINT_FORMAT, check_checkpoint, check_intact, model_of
from petfunc.io.formats import damage_of, is_petfunc_export, is_torchscript
from petfunc.io.metatrain import UnreadableCheckpointError, read_metatrain
from petfunc.io.params import FORMAT as PARAMS_FORMAT
from petfunc.io.params import params_from_payload


def load_model(
    path, dtype: torch.dtype | None = None, which: str = "best", device=None, target: str | None = None
):
    """``(config, params)`` from a training checkpoint, a :func:`petfunc.save_params`
    file, or (with metatrain installed) a metatrain checkpoint / exported model.

    ``which`` picks the parameters of a training checkpoint: ``"best"`` (default;
    ``best_params`` when present) or ``"last"``. ``target``: which energy target of
    a metatrain checkpoint (see :func:`petfunc.from_metatrain`); petfunc files have
    one, ``"energy"``. LoRA adapters are merged into the weights.
    """
    config, params, _ = load_model_and_lora(path, dtype, which, device, target, keep_lora=False)
    return config, params


def torch_payload(path):
    """``(torch.load(path, weights_only=True), None)``, or ``(None, error)`` where
    that fails (a metatrain checkpoint, whose objects it refuses, or a damaged
    file). An exported TorchScript model gives ``(None, None)`` unread: torch.load
    would load it with torch.jit.load, only to refuse it."""
    if is_torchscript(path):
        return None, None
    try:
        return torch.load(path, map_location="cpu", weights_only=True), None
    except Exception as error:  # noqa: BLE001 - whatever the archive or pickle raised
        return None, error


def load_model_and_lora(path, dtype, which, device, target, keep_lora: bool):
    """:func:`load_model`, plus ``lora``: with ``keep_lora``, a source's LoRA
    adapters stay in ``params["lora"]`` and ``lora`` is their ``{rank, alpha,
    targets}`` (else ``None``)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "model file"))
    if is_petfunc_export(path):
        raise ValueError(
            f"{str(path)!r} is a model written by petfunc export, which runs as it is: load it with "
            "petfunc.ase.PETCalculator.from_exported(path); petfunc eval, load_model and fine-tuning take "
            "the checkpoint or parameter file it was exported from"
        )
    payload, load_error = torch_payload(path)
    if payload is None:
        config, params, source_lora = _metatrain_model(path, load_error, target, which, keep_lora)
    else:
        config, params, source_lora = _petfunc_model(payload, path, target, which, keep_lora)
    params = _cast(params, dtype, device)
    return config, params, (source_lora if keep_lora and lora.KEY in params else None)


def _petfunc_model(payload, path: Path, target, which: str, keep_lora: bool):
    """``(config, params, lora)`` of a loaded petfunc checkpoint or parameter file."""
    kind = payload.get("format") if isinstance(payload, dict) else None
    if kind not in (CHECKPOINT_FORMAT, PARAMS_FORMAT):
        check_intact(payload, path)  # a flipped bit in the format tag says so
        raise ValueError(f"{str(path)!r} is not a petfunc checkpoint, parameter file or metatrain checkpoint")
    if target not in (None, "energy"):
        raise ValueError(f"{str(path)!r} is a petfunc file, whose only target is 'energy', not {target!r}")
    if kind == PARAMS_FORMAT:
        return (*params_from_payload(payload, path), None)
    config, params = model_of(check_checkpoint(payload, path), which)
    source_lora = None
    if lora.KEY in params:  # a LoRA fine-tuning run: merge its adapters, or keep them
        finetune = json.loads(payload["options"])["architecture"]["training"]["finetune"]
        source_lora = lora.config_of(finetune)
        if not keep_lora:
            params = lora.merge(params, lora.scaling_of(source_lora["alpha"], params))
    return config, params, source_lora


def _metatrain_model(path: Path, load_error, target, which: str, keep_lora: bool):
    """``(config, params, lora)`` of a file ``torch.load(weights_only=True)`` refused
    (``load_error``): a metatrain checkpoint or exported model, or a damaged file."""
    with open(path, "rb") as handle:
        magic = handle.read(4)
    if magic[:2] != b"\x1f\x8b" and magic != b"PK\x03\x04":
        damage = damage_of(path)
        raise ValueError(
            f"{str(path)!r} is not a model file"
            + (f": {damage}" if damage else "")
            + " (expected a petfunc checkpoint or parameter file, or a metatrain checkpoint)"
        )

    def damaged() -> ValueError:
        # a damaged archive (a truncated copy, say): torch's own reason says most
        first = str(load_error).splitlines()[0] if load_error is not None else ""
        # torch's own words help only where the file does not show its damage
        why = damage_of(path) or f"torch.load: {type(load_error).__name__}: {first}"
        return ValueError(
            f"{str(path)!r} is not a readable petfunc or metatrain model file, damaged or truncated? ({why})"
        )

    lora_out = {} if keep_lora else None
    try:
        config, params, _ = read_metatrain(path, target=target, lora_out=lora_out, which=which)
    except ImportError:
        try:  # a damaged archive says so whether metatrain is installed or not
            torch.serialization.get_unsafe_globals_in_checkpoint(path)
        except Exception:  # noqa: BLE001 - not a readable torch archive at all
            raise damaged() from None
        raise ValueError(
            f"{str(path)!r} is neither a petfunc checkpoint nor a petfunc parameter file "
            "(metatrain checkpoints need `pip install 'petfunc[metatrain]'`)"
        ) from None
    except UnreadableCheckpointError as error:
        raise damaged() from error
    return config, params, lora_out or None


def _cast(params, dtype, device):
    """Network weights to ``dtype`` (``None``: as stored) and ``device``; the
    composition weights and energy scale stay float64, as metatrain keeps them."""
    frozen = ("composition_weights", "energy_scale")

    def cast(name, t):
        keep64 = name in frozen
        return t.to(dtype=torch.float64 if keep64 else (dtype or t.dtype), device=device)

    return {
        k: (cast(k, v) if k in frozen else tree.tree_map(lambda t, k=k: cast(k, t), v))
        for k, v in params.items()
    }
