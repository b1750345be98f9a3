"""petfunc's parameter file, and the dtypes and devices of a parameter tree.

:func:`save_params` writes ``config`` and ``params`` as a ``torch.save`` of plain
data (strings, ints, the config as JSON and a ``{dotted.name: tensor}`` dict),
atomically, with a digest of its content (:mod:`petfunc.io.digest`);
:func:`load_params` reads it with ``torch.load(weights_only=True)``, so reading a
file never runs pickled code, and checks the digest (a file without one, written
before petfunc stored it, is read unchecked).

The composition weights and the energy scale (:data:`EXTRA_KEYS`) are kept in
float64 whatever the network dtype: :func:`petfunc.model.energy` casts them to the
computation dtype, as metatrain does with its float64 buffers. The checks of a tree
against its config (:func:`check_params`) are :mod:`petfunc.model.params`'s.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from petfunc import tree
from petfunc._files import PathLike, atomic_write, not_a_file
from petfunc.config import PETConfig
from petfunc.io.checkpoint import check_intact
from petfunc.io.digest import with_digest
from petfunc.io.formats import damage_of, is_petfunc_export, refused_objects
from petfunc.model.params import EXTRA_KEYS as EXTRA_KEYS
from petfunc.model.params import check_params as check_params
from petfunc.model.params import expected_shapes as expected_shapes


FORMAT = "petfunc.params"
FORMAT_VERSION = 1

#: the long-range weights, which metatrain's PET keeps outside ``backend.`` (its
#: ``long_range_featurizer`` also holds torch-pme buffers, which are not weights)
LONG_RANGE_WEIGHTS = ("long_range_featurizer.charges_map.", "long_range_featurizer.out_projection.")


# ---------------------------------------------------------------------------------------
# the dtypes and devices of a parameter tree (the checks against a config are
# petfunc.model.params's: the pure API uses them too)


def network_dtype(params) -> torch.dtype:
    """The dtype of the network weights (the first floating leaf outside ``EXTRA_KEYS``)."""
    for key, value in tree.flatten(params).items():
        if key not in EXTRA_KEYS and value.is_floating_point():
            return value.dtype
    return torch.get_default_dtype()


def cast_params(params, dtype, device):
    """Network weights to ``dtype``/``device``; the composition weights and energy
    scale (``EXTRA_KEYS``) and integer leaves keep their dtype."""
    flat = tree.flatten(params)
    out = {}
    for key, value in flat.items():
        keep = key in EXTRA_KEYS or not value.is_floating_point()
        out[key] = value.to(device=device, dtype=None if keep else dtype)
    return tree.unflatten(out)


# ---------------------------------------------------------------------------------------
# petfunc's own file format


def save_params(path: PathLike, config: PETConfig, params) -> None:
    """Write ``config`` and ``params`` to ``path`` (atomically; overwrites).

    The file is a ``torch.save`` of ``{"format", "format_version", "config" (JSON),
    "params" ({dotted.name: tensor}), "digest"}``: plain data that
    ``torch.load(path, weights_only=True)`` reads without running pickled code.
    Tensors are stored on the CPU with their own dtype.
    """
    if not isinstance(config, PETConfig):
        raise TypeError(f"config must be a PETConfig, got {type(config).__name__}")
    check_params(config, params)
    flat = {k: v.detach().to("cpu").clone().contiguous() for k, v in tree.flatten(params).items()}
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(config.to_hypers(), sort_keys=True),
        "params": flat,
    }
    payload = with_digest(payload)
    atomic_write(path, lambda handle: torch.save(payload, handle))


def load_params(path: PathLike, dtype: torch.dtype | None = None, device=None) -> tuple[PETConfig, Any]:
    """Read a file written by :func:`save_params`.

    Args:
        path: the file.
        dtype: cast every tensor to this dtype (default: keep the stored dtypes).
        device: put every tensor there (default: CPU).

    Returns:
        ``(config, params)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is unreadable, corrupt, not a petfunc parameter file, or
            its parameters do not match its config; a
            :class:`~petfunc.io.digest.DamagedFileError` where its content does not
            match its digest.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "petfunc parameter file"))
    if is_petfunc_export(path):
        raise ValueError(
            f"{str(path)!r} is a model written by petfunc export, not a parameter file: "
            "load it with petfunc.ase.PETCalculator.from_exported(path)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt archives and pickles raise many types
        damage = damage_of(path)
        if damage:  # torch's own words help only where the file does not show its damage
            raise ValueError(f"{str(path)!r} is not a readable petfunc parameter file: {damage}") from error
        refused = refused_objects(path, "a petfunc parameter file")
        if refused:  # a metatrain checkpoint is the harmless case of this
            raise ValueError(f"{refused}; for a metatrain checkpoint use petfunc.from_metatrain") from None
        raise ValueError(
            f"{str(path)!r} is not a readable petfunc parameter file "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''})"
        ) from error
    return params_from_payload(payload, path, dtype, device)


def params_from_payload(payload, path: PathLike, dtype: torch.dtype | None = None, device=None):
    """:func:`load_params` of an already loaded file ``payload`` (read from ``path``,
    which the errors name)."""
    if isinstance(payload, dict) and payload.get("format") == "petfunc.checkpoint":
        raise ValueError(
            f"{str(path)!r} is a petfunc training checkpoint, not a parameter file: read it with "
            "petfunc.load_model(path, which='best' or 'last'), or load the run's best_params.pt"
        )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        check_intact(payload, path)  # a flipped bit in the format tag says so
        raise ValueError(f"{str(path)!r} is not a petfunc parameter file (no '{FORMAT}' format tag)")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} has petfunc parameter format version {version!r}; this "
            f"petfunc reads version {FORMAT_VERSION}"
        )
    check_intact(payload, path)
    try:
        hypers = json.loads(payload["config"])
        config = PETConfig.from_hypers(hypers)
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r}: unreadable config ({error})") from error
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: invalid config: {error}") from error
    flat = payload.get("params")
    if not isinstance(flat, dict) or not all(isinstance(v, torch.Tensor) for v in flat.values()):
        raise ValueError(f"{str(path)!r}: 'params' is not a dict of tensors")
    params = tree.unflatten(flat)
    check_params(config, params, what=f"the parameters in {str(path)!r}")
    if dtype is not None or device is not None:
        params = tree.tree_map(lambda t: t.to(dtype=dtype or t.dtype, device=device), params)
    return config, params


# ---------------------------------------------------------------------------------------
# metatrain
