"""The ``architecture.training.finetune`` option: metatrain's fine-tuning methods
``full``, ``heads`` (readout only) and ``lora`` (low-rank adapters), and the
parameters each trains."""

from __future__ import annotations

from collections.abc import Mapping

from petfunc.lora import TRAIN
from petfunc.train import HEADS
from petfunc.trainer.options.checks import check_keys, module_names, number


FINETUNE_KEYS = ("read_from", "method", "config", "inherit_heads", "target_name")


def resolve_finetune(finetune: dict, target: str) -> None:
    """Check and complete a ``finetune`` section in place. ``target`` is the name of
    the trained energy target (``energy``, or the dataset's ``mtt::NAME``), by which
    metatrain keys ``inherit_heads``."""
    t = "architecture.training"
    check_keys(finetune, FINETUNE_KEYS, f"{t}.finetune")
    finetune.setdefault("method", "full")
    if finetune["method"] not in ("full", "heads", "lora"):
        raise ValueError(
            f"option '{t}.finetune.method' must be 'full', 'heads' or 'lora', got {finetune['method']!r}"
        )
    inherit = finetune.get("inherit_heads") or {}
    if not isinstance(inherit, Mapping):
        raise ValueError(f"option '{t}.finetune.inherit_heads' must be a mapping {{energy: SOURCE_TARGET}}")
    if target != "energy" and target in inherit:  # metatrain keys it by the trained target's name
        inherit = {("energy" if k == target else k): v for k, v in inherit.items()}
    check_keys(inherit, ("energy",), f"{t}.finetune.inherit_heads")
    if inherit and not isinstance(inherit["energy"], str):
        raise ValueError(
            f"option '{t}.finetune.inherit_heads.energy' must be the name of a target of the "
            f"checkpoint, got {inherit['energy']!r}"
        )
    if inherit and not finetune.get("read_from"):
        raise ValueError(f"option '{t}.finetune.inherit_heads' needs '{t}.finetune.read_from'")
    finetune["inherit_heads"] = dict(inherit)
    if finetune["method"] == "full" and finetune.get("config"):
        raise ValueError(f"option '{t}.finetune.config' is only used with methods 'heads' and 'lora'")
    if finetune["method"] != "full" and not finetune.get("read_from"):
        raise ValueError(
            f"option '{t}.finetune.method: {finetune['method']}' needs '{t}.finetune.read_from' "
            "(the model to fine-tune)"
        )
    if finetune["method"] == "lora":
        finetune["config"] = _lora_config(finetune.get("config") or {})
    if finetune["method"] == "heads":
        finetune["config"] = _heads_config(finetune.get("config") or {})
    if finetune.get("read_from") and target != "energy":
        # the name of the trained target decides, as in metatrain, whether the
        # checkpoint already has it (kept heads and weights) or it is new; the
        # resolved datasets call it 'energy', so it is kept here
        finetune["target_name"] = target
    if "target_name" in finetune and not isinstance(finetune["target_name"], str):
        raise ValueError(f"option '{t}.finetune.target_name' must be a target name")


def _lora_config(config: Mapping) -> dict:
    """The checked ``config`` of ``method: lora``: ``rank``, ``alpha``, ``target_modules``."""
    where = "architecture.training.finetune.config"
    check_keys(config, ("rank", "alpha", "target_modules"), where)
    config = dict(config)
    if "rank" in config:
        config["rank"] = number(config["rank"], f"{where}.rank", positive=True, integer=True)
    if "alpha" in config:
        config["alpha"] = number(config["alpha"], f"{where}.alpha", positive=True)
    module_names(config.get("target_modules", []), f"{where}.target_modules")
    return config


def _heads_config(config: Mapping) -> dict:
    """The checked ``config`` of ``method: heads``: ``head_modules``, ``last_layer_modules``."""
    where = "architecture.training.finetune.config"
    check_keys(config, ("head_modules", "last_layer_modules"), where)
    config = dict(config)
    for key, value in config.items():
        module_names(value, f"{where}.{key}")
    return config


def trained_parameters(finetune: Mapping) -> tuple[str, ...] | None:
    """The ``train`` selection (:func:`petfunc.train.trainable`) of a validated
    ``finetune`` section: ``None`` (everything) for ``method: full``, the adapters
    (:data:`petfunc.lora.TRAIN`) for ``lora``; for ``heads``,
    ``config.head_modules + config.last_layer_modules`` are path prefixes
    (metatrain's module names, with or without ``backend.``). An empty ``config``
    means metatrain's documented default, the node and edge heads and last layers."""
    method = finetune.get("method", "full")
    if method == "lora":
        return TRAIN
    if method != "heads":
        return None
    config = finetune.get("config") or {}
    if not config:
        return HEADS
    names = list(config.get("head_modules", [])) + list(config.get("last_layer_modules", []))
    return tuple(name[len("backend.") :] if name.startswith("backend.") else name for name in names)
