"""Fixed composition weights and energy scale in the options: metatrain's
``atomic_baseline`` and ``fixed_scaling_weights`` (numbers, or the paths of its
composition and scaler checkpoints)."""

from __future__ import annotations

import os
from collections.abc import Mapping

import numpy as np

from petfunc.trainer.options.checks import check_keys, number


def checkpoint_file(value) -> dict | None:
    """``{"file": path}`` if ``value`` names a metatrain checkpoint (a path, or that
    form already resolved, as a restart reads it back), else ``None``."""
    if isinstance(value, (str, os.PathLike)):
        return {"file": os.fspath(value)}
    if isinstance(value, Mapping) and set(value) == {"file"}:
        return {"file": os.fspath(value["file"])}
    return None


def atomic_baseline(value, where: str) -> dict:
    """``{}``, ``{"energy": float | {Z: float}}`` (metatrain's forms, energy only), or
    ``{"file": path}`` for a metatrain composition model checkpoint."""
    if (checkpoint := checkpoint_file(value)) is not None:
        return checkpoint
    if not isinstance(value, Mapping):
        raise ValueError(
            f"option '{where}' must be a mapping like {{energy: {{1: -13.6, 8: -2041.3}}}} "
            f"or the path of a metatrain composition model checkpoint, got {value!r}"
        )
    check_keys(value, ("energy",), where)
    if "energy" not in value:
        return {}
    energy = value["energy"]
    if isinstance(energy, Mapping):
        out = {}
        for z, w in energy.items():
            if isinstance(z, bool) or not isinstance(z, (int, str)) or not str(z).lstrip("-").isdigit():
                raise ValueError(f"option '{where}.energy': keys must be atomic numbers, got {z!r}")
            out[int(z)] = number(w, f"{where}.energy.{z}")
        return {"energy": out}
    return {"energy": number(energy, f"{where}.energy")}


def fixed_scaling_weights(value, where: str) -> dict:
    """``{}``, ``{"energy": c}`` with c > 0 (metatrain's form for a per-structure
    target), or ``{"file": path}`` for a metatrain scaler checkpoint."""
    if (checkpoint := checkpoint_file(value)) is not None:
        return checkpoint
    if not isinstance(value, Mapping):
        raise ValueError(
            f"option '{where}' must be a mapping like {{energy: 0.5}} or the path of a "
            f"metatrain scaler checkpoint, got {value!r}"
        )
    check_keys(value, ("energy",), where)
    if "energy" not in value:
        return {}
    if isinstance(value["energy"], Mapping):
        raise ValueError(
            f"option '{where}.energy': a scale per atomic type is not supported for the "
            "per-structure energy target (as in metatrain); give one number"
        )
    return {"energy": number(value["energy"], f"{where}.energy", positive=True)}


def fixed_composition(baseline: Mapping, atomic_types) -> np.ndarray | None:
    """Per-species energies from a resolved ``atomic_baseline`` (None: fit them).
    A mapping must list every atomic type of the model, as metatrain requires."""
    if "energy" not in baseline:
        return None
    energy = baseline["energy"]
    if not isinstance(energy, Mapping):
        return np.full(len(atomic_types), float(energy))
    missing = sorted({int(z) for z in atomic_types} - set(energy))
    if missing:
        raise ValueError(
            f"option 'architecture.training.atomic_baseline.energy' has no weight for atomic "
            f"type(s) {missing}; it must list every type of the model ({list(atomic_types)})"
        )
    return np.array([float(energy[int(z)]) for z in atomic_types])


def resolve_baselines(training: dict) -> None:
    """Resolve ``atomic_baseline`` and ``fixed_scaling_weights`` of the
    ``architecture.training`` section ``training`` in place."""
    t = "architecture.training"
    training["atomic_baseline"] = atomic_baseline(training["atomic_baseline"], f"{t}.atomic_baseline")
    training["fixed_scaling_weights"] = fixed_scaling_weights(
        training["fixed_scaling_weights"], f"{t}.fixed_scaling_weights"
    )
    if "file" in training["fixed_scaling_weights"] and "file" not in training["atomic_baseline"]:
        raise ValueError(
            f"option '{t}.fixed_scaling_weights' names a scaler checkpoint, which needs "
            f"'{t}.atomic_baseline' to name a composition checkpoint too (as in metatrain)"
        )
