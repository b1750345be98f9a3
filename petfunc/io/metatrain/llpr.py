"""The uncertainty quantities of metatrain's LLPR checkpoints (PET-MAD's kind).

An LLPR checkpoint wraps a PET checkpoint and adds, per energy target, the Cholesky
factor of the last-layer feature covariance, a calibrated multiplier and, optionally,
ensemble last-layer weights; :mod:`petfunc.llpr` computes with them.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from petfunc.config import PETConfig
from petfunc.io.metatrain.unpickle import copy_checkpoint
from petfunc.io.params import network_dtype


def llpr_state(checkpoint: Mapping) -> dict[str, torch.Tensor]:
    """The LLPR wrapper's own weights, as metatrain's ``"export"`` context picks them
    (``best_model_state_dict``, else ``model_state_dict``; ``state_dict`` before v3)."""
    for key in ("best_model_state_dict", "model_state_dict", "state_dict"):
        if checkpoint.get(key):
            return dict(checkpoint[key])
    return {}


def llpr_wrapped_checkpoint(checkpoint: Mapping, label: str) -> dict:
    """The PET checkpoint an LLPR uncertainty checkpoint (PET-MAD's kind) wraps.

    The wrapper's weights override the wrapped model's where they name them
    (``model.*``: metatrain loads them over the wrapped model, non-strictly)."""
    wrapped = checkpoint.get("wrapped_model_checkpoint")
    if not isinstance(wrapped, Mapping):
        raise ValueError(f"{label} is an LLPR checkpoint without a wrapped model checkpoint")
    inner = wrapped.get("architecture_name")
    if inner != "pet":
        raise ValueError(f"{label} is an LLPR checkpoint wrapping a {inner!r} model, not a PET")
    wrapped = copy_checkpoint(wrapped)
    overrides = {k[len("model.") :]: v for k, v in llpr_state(checkpoint).items() if k.startswith("model.")}
    if overrides:
        for key in ("best_model_state_dict", "model_state_dict"):
            if wrapped.get(key):
                wrapped[key] = {**wrapped[key], **overrides}
    return wrapped


def uncertainty_of(checkpoint: dict, config: PETConfig, params, dtype, target: str, label: str) -> dict:
    """The LLPR quantities of ``target`` in an LLPR ``checkpoint`` whose PET is
    ``(config, params)`` (called by :func:`petfunc.io.read_metatrain`)."""

    state = llpr_state(_upgraded(checkpoint, label))
    name = (
        "energy_uncertainty" if target == "energy" else f"mtt::aux::{target.replace('mtt::', '')}_uncertainty"
    )
    if f"cholesky_{name}" not in state:
        raise ValueError(f"{label} has no covariance for {name!r}; it holds {sorted(state)}")
    if f"multiplier_{name}" not in state:
        raise ValueError(f"{label} has no calibrated multiplier for {name!r}")
    dtype = dtype or network_dtype(params)
    llpr = {
        "cholesky": state[f"cholesky_{name}"].to(dtype),
        "multiplier": state[f"multiplier_{name}"].reshape(()).to(dtype),
    }
    weights = state.get(f"llpr_ensemble_layers.{target}.weight")
    if weights is not None:
        llpr["ensemble_weights"] = weights.to(dtype)
    features = 2 * config.num_readout_layers * config.d_head
    if llpr["cholesky"].shape != (features, features):
        raise ValueError(
            f"{label}: covariance of shape {tuple(llpr['cholesky'].shape)} for {features} last-layer features"
        )
    return llpr


def _upgraded(checkpoint: dict, label: str) -> dict:
    """The LLPR checkpoint at metatrain's latest LLPR version (older versions stored
    the inverse covariance instead of its Cholesky factor), upgraded by metatrain."""
    from metatrain.llpr import LLPRUncertaintyModel

    version = checkpoint.get("model_ckpt_version") or 1
    latest = LLPRUncertaintyModel.__checkpoint_version__
    if version > latest:
        raise ValueError(
            f"{label} has LLPR model version {version}; the installed metatrain reads up to {latest}"
        )
    if version == latest:
        return checkpoint
    checkpoint = copy_checkpoint(checkpoint)
    checkpoint["model_ckpt_version"] = version
    return LLPRUncertaintyModel.upgrade_checkpoint(checkpoint)
