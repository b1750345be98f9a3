"""The model a run starts from: the restart checkpoint's, a fine-tuning checkpoint's
(its heads, its LoRA adapters), or a fresh one; and the LoRA adapters it trains."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping

import torch

from petfunc import lora, tree
from petfunc.config import PETConfig, checked_atomic_types
from petfunc.io.load import load_model_and_lora
from petfunc.model import PET


def check_model_section(model_hypers: Mapping, config: PETConfig, what: str) -> None:
    """Raise unless every hyperparameter the options name equals ``config``'s.

    As metatrain's ``raise_if_hypers_mismatch`` on restart and fine-tuning, only the
    keys given are compared (a nested section such as ``long_range`` is filled with
    its defaults first); the architecture itself comes from the checkpoint.
    """
    if model_hypers.get("atomic_types") is not None:
        # atomic numbers or chemical symbols, as PETConfig takes them
        added = sorted(set(checked_atomic_types(model_hypers["atomic_types"])) - set(config.atomic_types))
        if added:  # a PET model's types are fixed; metatrain refuses new types too
            raise ValueError(
                f"option 'architecture.atomic_types' has type(s) {added} that the model of {what} "
                f"lacks (it has {list(config.atomic_types)}); a PET model cannot add atomic types"
            )
    given = {k: v for k, v in model_hypers.items() if k != "atomic_types"}
    if not given:
        return
    try:
        merged = PETConfig.from_hypers({**config.to_hypers(), **given})
    except ValueError as error:
        raise ValueError(f"option 'architecture.model': {error}") from None
    diff = [
        f"{k}: {getattr(merged, k)!r} here, {getattr(config, k)!r} in it"
        for k in given
        if getattr(merged, k) != getattr(config, k)
    ]
    if diff:
        raise ValueError(
            f"option 'architecture.model' differs from the architecture of {what} ("
            + "; ".join(diff)
            + "); remove these keys or make them match"
        )


def target_params(path, name: str, dtype, device):
    """The parameters of target ``name`` of a model file, or ``None`` if it has no
    such target."""
    try:
        return load_model_and_lora(path, dtype, "best", device, name, False)[1]
    except ValueError as error:
        if lacks_target(error):
            return None
        raise


def lacks_target(error: ValueError) -> bool:
    """Whether ``error`` of :func:`petfunc.io.load.load_model_and_lora` says the file has no such target (a
    metatrain checkpoint without it, or a petfunc file, whose only target is energy)."""
    return "no target" in str(error) or "only target is" in str(error)


def restarted_model(ckpt: Mapping, restart, model_hypers: Mapping, dtype: torch.dtype, device):
    """``(config, params)`` of the restart checkpoint ``ckpt`` (read from ``restart``),
    parameters on ``device``; the options' ``model_hypers`` and ``dtype`` must agree
    with it."""
    config = PETConfig.from_hypers(json.loads(ckpt["config"]))
    check_model_section(model_hypers, config, f"the restart checkpoint {str(restart)!r}")
    stored = ckpt.get("dtype")
    if stored != str(dtype).replace("torch.", ""):
        raise ValueError(f"the restart checkpoint was trained in {stored}; set base_precision to match")
    params = tree.tree_map(lambda t: t.to(device), tree.unflatten(dict(ckpt["params"])))
    return config, params


def initial_model(options: Mapping, model_hypers: Mapping, atomic_types, dtype, device, seed: int, log):
    """``(config, params)`` a run that does not restart starts from: the fine-tuning
    checkpoint's (:func:`finetuned_model`), or a fresh model of ``model_hypers``
    (``atomic_types`` where they name none) initialised from ``seed``."""
    if options["architecture"]["training"]["finetune"].get("read_from"):
        return finetuned_model(options, model_hypers, dtype, device, log)
    hypers = dict(model_hypers)
    hypers.setdefault("atomic_types", atomic_types)
    try:  # the options checked each value; here the relations between them (d_pet, num_heads, ...)
        config = PETConfig.from_hypers(hypers)
    except ValueError as error:
        raise ValueError(f"option 'architecture.model': {error}") from None
    params = PET(config).init(seed=seed, dtype=dtype, device=device)
    return config, params


def finetuned_model(options: Mapping, model_hypers: Mapping, dtype, device, log: Callable[[str], None]):
    """``(config, params)`` of the fine-tuning checkpoint of ``options``: the heads of
    the trained target (or of ``inherit_heads``' source), its LoRA adapters kept
    apart for ``method: lora`` (whose ``config`` then becomes theirs, so that
    checkpoints and restarts agree), merged otherwise."""
    finetune_options = options["architecture"]["training"]["finetune"]
    finetune = finetune_options["read_from"]
    # metatrain's inherit_heads {energy: SOURCE}: the energy heads start from the
    # source target's heads
    source = (finetune_options.get("inherit_heads") or {}).get("energy")
    name = finetune_options.get("target_name", "energy")
    # metatrain fine-tunes the checkpoint's target of the dataset's name, or
    # starts new heads for a target it lacks
    by_name = source is None and name != "energy"
    if by_name:
        source = name
    # method 'lora' on a model fine-tuned with LoRA trains its adapters on, as
    # metatrain does (it injects no new ones); other methods merge them
    continue_lora = finetune_options.get("method") == "lora"
    try:
        config, params, source_lora = load_model_and_lora(
            finetune, dtype, "best", device, source, continue_lora
        )
    except ValueError as error:
        if by_name and lacks_target(error):
            raise ValueError(
                f"the fine-tuning checkpoint {finetune!r} has no target {name!r}: metatrain would start new "
                f"heads for it, petfunc starts from one of the checkpoint's: name it with "
                f"'architecture.training.finetune.inherit_heads: {{energy: SOURCE}}'"
            ) from None
        if source is None and "pass target=" in str(error):
            raise ValueError(
                str(error).replace(
                    "pass target=...",
                    "choose one with 'architecture.training.finetune.inherit_heads: {energy: NAME}'",
                )
            ) from None
        raise
    check_model_section(model_hypers, config, f"the fine-tuning checkpoint {finetune!r}")
    log(
        f"fine-tuning from {finetune} ({len(config.atomic_types)} atomic types {config.atomic_types})"
        + (f", heads of its target {source!r}" if source else "")
    )
    if source_lora is not None:
        given = finetune_options.get("config") or {}
        effective = {
            "rank": source_lora["rank"],
            "alpha": source_lora["alpha"],
            "target_modules": list(source_lora["targets"]),
        }
        if any(given.get(k, effective[k]) != effective[k] for k in effective):
            log(
                f"the model already has LoRA adapters: training them on (rank {effective['rank']}, alpha "
                f"{effective['alpha']:g}) as metatrain does, instead of finetune.config {given}"
            )
        finetune_options["config"] = effective  # stored in checkpoints: a restart agrees
    return config, params


def with_adapters(finetune: Mapping, config: PETConfig, params, seed: int, log: Callable[[str], None]):
    """``(model, params, lora_config)`` for the ``finetune`` section: with ``method:
    lora``, adapters ``params["lora"]`` (a restart brings its own) and a model that
    evaluates ``W + (alpha / rank) B A``; else a plain :class:`PET` (and ``None``)."""
    lora_config = lora.config_of(finetune)
    if lora_config is None:
        return PET(config), params, None
    if lora.KEY not in params:
        params = lora.attach(params, lora_config["rank"], lora_config["targets"], seed=seed)
    model = lora.LoRAPET(config, lora.scaling_of(lora_config["alpha"], params))
    log(
        f"LoRA adapters of rank {lora_config['rank']} (alpha {lora_config['alpha']:g}) on "
        f"{len(lora.target_layers(params, lora_config['targets']))} layers"
    )
    return model, params, lora_config
