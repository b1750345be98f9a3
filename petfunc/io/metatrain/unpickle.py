"""Unpickling metatrain checkpoints so that no pickled code runs.

A metatrain checkpoint is a pickle. It loads here with
``torch.load(weights_only=True)``, allowing only the objects metatrain checkpoints
hold (its dataset and target descriptions; metatensor layouts, which unpickle as
TorchScript objects of registered C++ classes). A file holding anything else is
refused with the names of those objects, unless ``PETFUNC_TRUST_CHECKPOINTS=1``.
"""

from __future__ import annotations

import copy
import gzip
import importlib
import io
import os
import pickle
from collections.abc import Mapping
from pathlib import Path

import torch

from petfunc._files import not_a_file
from petfunc.io.formats import is_petfunc_export


def require_metatrain():
    try:
        import metatensor.torch  # noqa: F401  (registers TorchScript classes)
        import metatomic.torch  # noqa: F401
        from metatrain.pet import PET as MetatrainPET
    except ImportError as error:
        raise ImportError(
            "reading metatrain checkpoints needs metatrain, an optional dependency: "
            "install it with `pip install 'petfunc[metatrain]'`"
        ) from error
    return MetatrainPET


def read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "metatrain checkpoint"))
    if is_petfunc_export(path):
        raise ValueError(
            f"{str(path)!r} is a model written by petfunc export, not a metatrain checkpoint: "
            "load it with petfunc.ase.PETCalculator.from_exported(path)"
        )
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip magic, whatever the extension
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise ValueError(f"{str(path)!r}: corrupt gzip file ({error})") from error
    return data


#: Environment variable that lets :func:`unpickle_checkpoint` fall back to a full
#: unpickling (which can run code) for a trusted checkpoint holding other objects.
TRUST_ENV = "PETFUNC_TRUST_CHECKPOINTS"


def _checkpoint_globals():
    """The only non-tensor objects metatrain checkpoints hold (every shipped version,
    model v1 to v16 and LLPR): its dataset and target descriptions, and metatensor
    ``TensorMap`` layouts, which unpickle as TorchScript objects of a registered C++
    class (built from their serialized buffer, not by running pickled code)."""

    allowed = [torch.ScriptObject]
    for module, name in (
        ("metatrain.utils.data.dataset", "DatasetInfo"),
        ("metatrain.utils.data.target_info", "TargetInfo"),
    ):
        try:  # a metatrain that moved them: the refusal names them instead
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return allowed


class UnreadableCheckpointError(ValueError):
    """A metatrain checkpoint file that cannot be read at all (a damaged archive or
    pickle), as opposed to one that reads but holds something petfunc refuses."""


def unpickle_checkpoint(data: bytes, label: str):
    """A metatrain checkpoint's dict, read with ``torch.load(weights_only=True)`` and
    :func:`_checkpoint_globals` allowed, so no pickled code runs. A checkpoint with
    any other object is refused with its names, unless ``PETFUNC_TRUST_CHECKPOINTS=1``
    allows a full unpickling."""

    try:
        with torch.serialization.safe_globals(_checkpoint_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if os.environ.get(TRUST_ENV, "") not in ("", "0"):
            try:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
            except Exception as error2:
                raise UnreadableCheckpointError(
                    f"{label} is not a readable metatrain checkpoint ({type(error2).__name__}: {error2})"
                ) from error2
        names = _unsafe_globals(data)
        if not names:  # a damaged pickle, not a refused object
            raise UnreadableCheckpointError(
                f"{label} is not a readable metatrain checkpoint (UnpicklingError: "
                f"{str(error).splitlines()[0]})"
            ) from error
        raise ValueError(
            f"{label} holds pickled objects that petfunc does not unpickle ({', '.join(names)}): "
            f"loading them could run code. If you trust this file, set {TRUST_ENV}=1"
        ) from None
    except Exception as error:  # corrupt archives raise many types
        raise UnreadableCheckpointError(
            f"{label} is not a readable metatrain checkpoint ({type(error).__name__}: {error})"
        ) from error


def _unsafe_globals(data: bytes):
    """Names of the objects in a ``torch.save`` archive that :func:`unpickle_checkpoint`
    does not allow (empty if the archive cannot be read)."""
    with torch.serialization.safe_globals(_checkpoint_globals()):
        try:
            return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))))
        except Exception:  # noqa: BLE001 - an unreadable archive names no objects
            return []


def copy_checkpoint(checkpoint: Mapping) -> dict:
    """Copy what :meth:`PET.upgrade_checkpoint` mutates, sharing the tensors."""
    out = {k: v for k, v in checkpoint.items() if "optimizer" not in k and "scheduler" not in k}
    for key in ("model_data", "train_hypers"):
        if key in out:
            out[key] = copy.deepcopy(out[key])
    for key in ("model_state_dict", "best_model_state_dict"):
        state = out.get(key)
        if state is not None:
            out[key] = {
                k: (copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v) for k, v in state.items()
            }
    return out
