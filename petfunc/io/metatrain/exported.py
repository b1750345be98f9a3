"""Reading an exported metatomic model (``mtt export``'s ``model.pt``) of a PET."""

from __future__ import annotations

import io

import numpy as np
import torch

from petfunc.io.metatrain.convert import (
    assemble_params,
    composition_and_scale,
    config_from_hypers,
    in_angstrom_and_ev,
    merge_lora,
    network_params,
    zbl_as_metatrain,
)
from petfunc.model import TARGET


#: the hypers an exported PET keeps as attributes of its backend
_HYPERS = (
    "cutoff",
    "cutoff_function",
    "cutoff_width",
    "num_neighbors_adaptive",
    "adaptive_cutoff_method",
    "d_pet",
    "d_node",
    "d_head",
    "d_feedforward",
    "num_heads",
    "num_gnn_layers",
    "num_attention_layers",
    "normalization",
    "activation",
    "attention_temperature",
    "transformer_type",
    "featurizer_type",
)


def as_written(value) -> float:
    """A hyperparameter an exported model keeps as a tensor: a float32 one reads back
    as the decimal it was written as (1.1, not 1.100000023841858), so that its config
    equals the checkpoint's."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return float(np.format_float_positional(np.float32(value.item()), unique=True))
    return float(value)


def from_exported(data: bytes, dtype, target, label):
    """An exported metatomic ``AtomisticModel`` wrapping a metatrain PET."""
    module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    pet = getattr(module, "module", module)
    try:
        backend = pet.backend
    except AttributeError:
        if hasattr(pet, "model") and hasattr(pet.model, "backend"):
            # metatrain's LLPR wraps the PET; its exported form keeps no checkpoint data
            raise ValueError(
                f"{label} is an exported LLPR model (a PET inside metatrain's uncertainty "
                "wrapper): petfunc reads those from the LLPR checkpoint (.ckpt), "
                "petfunc.llpr.from_metatrain"
            ) from None
        raise ValueError(f"{label} is a TorchScript file but not an exported PET") from None
    hypers, atomic_types = _hypers(pet, backend, label)
    state = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in module.state_dict().items()}
    # PET's additive models are [composition] or [composition, ZBL]
    hypers["zbl"] = any(k.startswith("additive_models.1.") for k in state)
    config = config_from_hypers(hypers, atomic_types, label)

    # the exported LoRA modules carry their own alpha / rank
    def scaling(prefix, rank):
        module = pet
        for part in prefix.split("."):  # ScriptModules have no get_submodule
            module = getattr(module, part)
        return module.scaling

    state = merge_lora(state, scaling)

    outputs = [k.split(".")[2] for k in state if k.startswith("backend.node_heads.")]
    targets = sorted(set(outputs))
    if target is None:
        target = TARGET if TARGET in targets else (targets[0] if len(targets) == 1 else None)
    if target not in targets:
        raise ValueError(f"{label}: cannot pick the energy target among {targets}; pass target=...")
    network = network_params(state, target)
    weights, scale = composition_and_scale(state, target, config.atomic_types)
    params = assemble_params(config, network, weights, scale, dtype, label)
    try:
        capabilities = module.capabilities()
        length_unit, energy_unit = str(capabilities.length_unit), str(capabilities.outputs[target].unit)
    except Exception as error:  # noqa: BLE001 - a TorchScript error of an unknown export
        raise ValueError(f"{label}: cannot read the units of the exported model ({error})") from None
    config, params, _ = in_angstrom_and_ev(
        zbl_as_metatrain(config, energy_unit), params, length_unit, energy_unit, label
    )
    return config, params


def _hypers(pet, backend, label: str) -> tuple[dict, list]:
    """``(hypers, atomic types)`` of an exported PET, read from its modules."""
    try:
        hypers = {n: getattr(backend, n) for n in _HYPERS}
        hypers["cutoff_width_adaptive"] = pet.cutoff_width_adaptive
        atomic_types = list(pet.atomic_types)
    except AttributeError as error:
        raise ValueError(f"{label}: not an exported PET of a known version ({error})") from None
    conditioning = getattr(backend, "system_conditioning", None)
    hypers["system_conditioning"] = conditioning is not None
    if conditioning is not None:
        hypers["max_charge"] = int(conditioning.max_charge)
        hypers["max_spin_multiplicity"] = int(conditioning.max_spin_multiplicity)
    hypers["long_range"] = {"enable": bool(getattr(pet, "long_range", False))}
    if hypers["long_range"]["enable"]:
        try:
            featurizer = pet.long_range_featurizer
            p3m = featurizer.p3m_calculator
            hypers["long_range"].update(
                use_ewald=bool(featurizer.use_ewald),
                smearing=as_written(p3m.potential.smearing),
                kspace_resolution=as_written(p3m.mesh_spacing),
                interpolation_nodes=int(p3m.interpolation_nodes),
            )
        except AttributeError as error:
            raise ValueError(f"{label}: cannot read the long-range settings ({error})") from None
    return hypers, atomic_types
