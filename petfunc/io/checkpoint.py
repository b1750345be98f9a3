"""The training checkpoint of ``petfunc train``: its one writer and its one reader.

A checkpoint (``last.ckpt``, ``best.ckpt``, ``epoch_N.ckpt``) is a ``torch.save``
file of plain data (strings, numbers, lists, dicts and tensors; the torchopt
NamedTuple state is stored as nested dicts), so it loads with
``torch.load(path, weights_only=True)`` and reading it runs no pickled code. It is
written to a temporary file and renamed over the old one, so a kill never leaves a
half-written checkpoint. Keys:

``format``, ``format_version``, ``petfunc_version``
    ``"petfunc.checkpoint"``, :data:`CHECKPOINT_VERSION`, the writer's version.
``config``
    the model hypers (JSON).
``params``, ``best_params``
    ``{dotted name: tensor}`` of the current and the best parameters (CPU).
``opt_state``
    the optimizer state, as :func:`state_to_plain` stores it.
``epoch``, ``step``, ``best_epoch``, ``best_metric``
    completed epochs and steps; the best epoch and its validation metric.
``composition``, ``energy_scale``
    ``{"atomic_types", "weights"}`` (float64) and the energy scale.
``dtype``, ``rng``, ``options``, ``history``, ``split``, ``world_size``
    the training dtype; the seed and torch's global RNG state; the resolved options
    (JSON); one dict of metrics per epoch; the file indices of the training,
    validation and test structures with a digest of each file; the number of
    processes that trained it.
``digest``
    ``"sha256:..."`` of all of the above (:mod:`petfunc.io.digest`), checked on
    reading; a checkpoint without one (written before petfunc stored it) is read
    unchecked.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petfunc import tree
from petfunc._files import atomic_write, not_a_file
from petfunc.config import PETConfig
from petfunc.io.digest import DamagedFileError, check_digest, with_digest
from petfunc.io.formats import damage_of, pickled_objects, refused_objects


CHECKPOINT_FORMAT = "petfunc.checkpoint"
CHECKPOINT_VERSION = 1


def _cpu_flat(params) -> dict[str, torch.Tensor]:
    """``{dotted name: tensor}`` of ``params``, detached copies on the CPU."""
    return {k: v.detach().to("cpu").clone() for k, v in tree.flatten(params).items()}


def write_checkpoint(
    path,
    *,
    config: PETConfig,
    params,
    opt_state,
    epoch: int,
    step: int,
    best_epoch: int,
    best_metric: float,
    best_params,
    composition: Sequence[float] | np.ndarray | torch.Tensor,
    energy_scale: float,
    dtype: torch.dtype,
    seed: int,
    options: Mapping,
    history: Sequence[Mapping],
    split: Mapping,
    world_size: int,
    version: str,
) -> None:
    """Write a training checkpoint to ``path`` atomically (keys: see the module doc).

    ``best_metric`` may be ``inf`` (no epoch validated yet; stored as ``None``) and
    ``best_params`` ``None``; ``options`` are the run's resolved options; ``version``
    is the writing petfunc's.
    """
    payload = {
        "format": CHECKPOINT_FORMAT,
        "format_version": CHECKPOINT_VERSION,
        "petfunc_version": version,
        "config": json.dumps(config.to_hypers(), sort_keys=True),
        "params": _cpu_flat(params),
        "opt_state": state_to_plain(opt_state),
        "epoch": int(epoch),
        "step": int(step),
        "best_epoch": int(best_epoch),
        "best_metric": None if math.isinf(best_metric) else float(best_metric),
        "best_params": None if best_params is None else _cpu_flat(best_params),
        "composition": {
            "atomic_types": list(config.atomic_types),
            "weights": torch.as_tensor(composition, dtype=torch.float64),
        },
        "energy_scale": float(energy_scale),
        "dtype": str(dtype).replace("torch.", ""),
        "rng": {"seed": int(seed), "torch": torch.get_rng_state()},
        "options": json.dumps(options, sort_keys=True),
        "history": [dict(row) for row in history],
        "split": split,
        "world_size": int(world_size),  # processes that trained it (batch_size is per process)
    }
    payload = with_digest(payload)
    atomic_write(path, lambda handle: torch.save(payload, handle), what="checkpoint")


def is_checkpoint(payload: Any) -> bool:
    """Whether a loaded file ``payload`` is a training checkpoint (any version)."""
    return isinstance(payload, dict) and payload.get("format") == CHECKPOINT_FORMAT


def model_of(payload: Mapping, which: str = "best") -> tuple[PETConfig, Any]:
    """``(config, params)`` of a checked checkpoint ``payload``: its best parameters
    (``which="best"``, when it has them) or its last ones (``"last"``), as stored
    (CPU tensors; LoRA adapters, if any, in ``params["lora"]``)."""
    config = PETConfig.from_hypers(json.loads(payload["config"]))
    flat = payload["best_params"] if which == "best" and payload.get("best_params") else payload["params"]
    return config, tree.unflatten(dict(flat))


def state_to_plain(state):
    """A torchopt state (NamedTuples, tuples, lists, dicts of tensors) as plain
    dicts/lists of CPU tensors; NamedTuples become ``{"__namedtuple__": name, field: ...}``."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu").clone()
    if isinstance(state, tuple) and hasattr(state, "_fields"):
        out = {"__namedtuple__": type(state).__name__}
        out.update({f: state_to_plain(getattr(state, f)) for f in state._fields})
        return out
    if isinstance(state, (list, tuple)):
        return [state_to_plain(x) for x in state]
    if isinstance(state, dict):
        return {str(k): state_to_plain(v) for k, v in state.items()}
    if state is None or isinstance(state, (bool, int, float, str)):
        return state
    raise TypeError(f"cannot store optimizer state of type {type(state).__name__}")


def state_from_plain(plain, template, where: str = "opt_state"):
    """Inverse of :func:`state_to_plain`, guided by ``template`` (``optimizer.init(...)``),
    whose types, dtypes and devices it restores. Raises ``ValueError`` on any mismatch."""
    if isinstance(template, torch.Tensor):
        if not isinstance(plain, torch.Tensor) or plain.shape != template.shape:
            got = list(plain.shape) if isinstance(plain, torch.Tensor) else type(plain).__name__
            raise ValueError(f"{where}: expected a tensor of shape {list(template.shape)}, got {got}")
        return plain.to(dtype=template.dtype, device=template.device)
    if isinstance(template, tuple) and hasattr(template, "_fields"):
        name = type(template).__name__
        if not isinstance(plain, Mapping) or plain.get("__namedtuple__") != name:
            raise ValueError(f"{where}: expected a {name}")
        return type(template)(
            *[state_from_plain(plain[f], getattr(template, f), f"{where}.{f}") for f in template._fields]
        )
    if isinstance(template, (list, tuple)):
        if not isinstance(plain, (list, tuple)) or len(plain) != len(template):
            raise ValueError(f"{where}: expected a sequence of length {len(template)}")
        return type(template)(
            state_from_plain(p, t, f"{where}.{i}") for i, (p, t) in enumerate(zip(plain, template))
        )
    if isinstance(template, dict):
        if not isinstance(plain, Mapping) or set(plain) != {str(k) for k in template}:
            raise ValueError(f"{where}: keys differ from the optimizer's")
        return {k: state_from_plain(plain[str(k)], v, f"{where}.{k}") for k, v in template.items()}
    return template


def read_checkpoint(path) -> dict:
    """Read a ``petfunc train`` checkpoint (``torch.load(weights_only=True)``).

    Raises:
        FileNotFoundError: no such file.
        ValueError: unreadable, or not a petfunc training checkpoint.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "checkpoint file"))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:
        if any(name.startswith("metatrain.") for name in pickled_objects(path)):
            raise ValueError(
                f"{str(path)!r} is a metatrain checkpoint, not a petfunc training checkpoint: a run "
                "continues from its own last.ckpt; to train on from a metatrain model, fine-tune it "
                "(--finetune, or architecture.training.finetune.read_from)"
            ) from None
        refused = refused_objects(path, "a petfunc training checkpoint")
        if refused:
            raise ValueError(refused) from None
        # torch's own words help only where the file does not show its damage
        why = damage_of(path) or f"damaged or truncated? ({type(error).__name__}: {str(error)[:200]})"
        raise ValueError(
            f"{str(path)!r} is not a readable petfunc checkpoint: {why.splitlines()[0]}; {instead_of(path)}"
        ) from error
    return check_checkpoint(payload, path)


def check_checkpoint(payload, path) -> dict:
    """:func:`read_checkpoint`'s checks of a loaded ``payload`` (read from ``path``).

    Raises:
        DamagedFileError (a ``ValueError``): its content does not match its digest;
            the message names the newest intact checkpoint beside it.
        ValueError: not a petfunc training checkpoint, or of another version.
    """
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        check_intact(payload, path)  # a flipped bit in the format tag says so
        raise ValueError(f"{str(path)!r} is not a petfunc training checkpoint")
    if payload.get("format_version") != CHECKPOINT_VERSION:
        # another version's digest may differ in kind: its version is the news
        raise ValueError(
            f"{str(path)!r} has checkpoint version {payload.get('format_version')!r}; this petfunc "
            f"reads version {CHECKPOINT_VERSION}"
        )
    check_intact(payload, path)
    return payload


def check_intact(payload, path) -> None:
    """:func:`petfunc.io.digest.check_digest` of a loaded checkpoint or parameter file
    ``payload``, whose error names the newest intact checkpoint beside ``path``."""
    try:
        check_digest(payload, path)
    except DamagedFileError as error:
        raise DamagedFileError(f"{error}; {instead_of(path)}") from None


def instead_of(path) -> str:
    """What to use instead of a damaged file at ``path``: the newest intact
    checkpoint beside it (:func:`intact_checkpoint_beside`), or a copy."""
    found = intact_checkpoint_beside(path)
    if found is None:
        return "no intact checkpoint is beside it: restore it from a copy"
    return (
        f"the newest intact checkpoint beside it is {str(found[0])!r} (epoch {found[1]}): use it "
        "instead (petfunc eval and petfunc.load_model read it, and --restart continues its run)"
    )


def intact_checkpoint_beside(path, tries: int = 8) -> tuple[Path, int] | None:
    """``(path, epoch)`` of the newest (last modified) training checkpoint in ``path``'s
    folder, other than ``path``, that reads and matches its digest; ``None`` if none
    of the ``tries`` newest ``*.ckpt`` files there does."""
    path = Path(path)
    try:
        candidates = [p for p in path.parent.glob("*.ckpt") if p.is_file() and p.name != path.name]
        candidates.sort(key=lambda p: p.stat().st_mtime_ns, reverse=True)
    except OSError:
        return None
    for candidate in candidates[:tries]:
        try:
            payload = torch.load(candidate, map_location="cpu", weights_only=True)
            check_digest(payload, candidate)
        except Exception:  # noqa: BLE001 - unreadable or damaged: try the next one
            continue
        if is_checkpoint(payload) and isinstance(payload.get("epoch"), int):
            return candidate, payload["epoch"]
    return None
