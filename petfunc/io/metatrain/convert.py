"""metatrain's state dicts to petfunc's parameters and back.

metatrain's PET keeps its network weights under ``backend.*`` (the long-range weights
under ``long_range_featurizer.*``), its composition weights and energy scale in
metatensor buffers, and LoRA adapters beside the weights they adapt. petfunc's
parameters are the same weights without the ``backend.`` prefix, the energy head
named ``energy``, plus ``composition_weights`` and ``energy_scale``, in Å and eV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch

from petfunc import tree
from petfunc.config import PETConfig
from petfunc.io.params import EXTRA_KEYS, LONG_RANGE_WEIGHTS, check_params, expected_shapes
from petfunc.model import BLOCK, TARGET


def choose_target(dataset_info, target: str | None) -> str:
    targets = dict(dataset_info.targets)
    if target is not None:
        if target not in targets:
            raise ValueError(f"the checkpoint has no target {target!r}; it has {sorted(targets)}")
        return target
    if TARGET in targets:
        return TARGET
    energies = [name for name, info in targets.items() if getattr(info, "quantity", None) == "energy"]
    if len(energies) == 1:
        return energies[0]
    raise ValueError(
        f"cannot tell which target of the checkpoint is the energy (targets: "
        f"{sorted(targets)}); pass target=..."
    )


def split_lora(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(state with every LoRA-wrapped linear's X.linear.* renamed X.*, the adapters
    X.lora_A/B.weight)``: the base weights and the adapters kept apart."""
    out, adapters = {}, {}
    wrapped = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            adapters[key] = value
            continue
        for prefix in wrapped:
            if key.startswith(prefix + ".linear."):
                key = prefix + "." + key[len(prefix + ".linear.") :]
                break
        out[key] = value
    return out, adapters


def merge_lora(state: dict[str, torch.Tensor], scaling_of) -> dict[str, torch.Tensor]:
    """Replace every LoRA-wrapped linear (``X.linear.*``, ``X.lora_A/B.weight``) by a
    plain ``X.weight = W + s * B @ A`` and ``X.bias``; ``s = scaling_of(X, rank)``."""
    out, adapters = split_lora(state)
    for key, a in adapters.items():
        if not key.endswith(".lora_A.weight"):
            continue
        prefix = key[: -len(".lora_A.weight")]
        b = adapters[f"{prefix}.lora_B.weight"]
        w = out[f"{prefix}.weight"]
        scaling = float(scaling_of(prefix, a.shape[0]))
        out[f"{prefix}.weight"] = (w.double() + scaling * (b.double() @ a.double())).to(w.dtype)
    return out


def network_params(state: Mapping[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """``backend.*`` weights without prefix, the chosen target's heads renamed to
    petfunc's ``energy`` / ``energy___0``, other targets' heads dropped."""
    heads = ("node_heads.", "edge_heads.", "node_last_layers.", "edge_last_layers.")
    prefix = "backend."
    out = {}
    for key, value in state.items():
        if key.startswith(LONG_RANGE_WEIGHTS):
            out[key] = value  # not under backend. in metatrain's PET
            continue
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name == "species_to_species_index":
            continue
        if name.startswith(heads):
            group, rest = name.split(".", 1)
            if not rest.startswith(f"{target}."):
                continue  # another target's head
            rest = rest[len(target) + 1 :]
            if group.endswith("last_layers"):
                layer, block, leaf = rest.split(".", 2)
                if block != f"{target}___0":
                    raise ValueError(
                        f"target {target!r} has a last-layer block {block!r}; petfunc "
                        "supports a single scalar energy block"
                    )
                rest = f"{layer}.{BLOCK}.{leaf}"
            name = f"{group}.{TARGET}.{rest}"
        out[name] = value
    return out


def composition_and_scale(state, target: str, atomic_types):
    import metatensor.torch as mts

    comp_keys = [
        k for k in state if k.startswith("additive_models.") and k.endswith(f".{target}_composition_buffer")
    ]
    if len(comp_keys) != 1:
        raise ValueError(f"expected one composition buffer for target {target!r}, found {comp_keys}")
    block = mts.load_buffer(state[comp_keys[0]]).block()
    values = block.values.detach().to(torch.float64).reshape(-1)
    if values.shape[0] != len(block.samples):
        raise ValueError("the composition block does not hold one weight per atomic type")
    column = block.samples.names.index("center_type")
    by_type = {int(s[column]): values[n] for n, s in enumerate(block.samples.values)}
    weights = torch.stack([by_type.get(int(t), torch.zeros((), dtype=torch.float64)) for t in atomic_types])

    scale_key = f"scaler.{target}_scaler_buffer"
    if scale_key not in state:
        raise ValueError(f"the checkpoint has no scaler buffer {scale_key!r}")
    scale_values = mts.load_buffer(state[scale_key]).block().values.detach()
    if scale_values.numel() != 1:
        raise ValueError(
            f"the energy scale of target {target!r} has {scale_values.numel()} entries; "
            "petfunc supports one scale per target"
        )
    return weights, scale_values.reshape(()).to(torch.float64)


def assemble_params(config, network, weights, scale, dtype, source):
    if dtype is None:
        floats = [v.dtype for v in network.values() if v.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    flat = {k: v.detach().to(dtype) for k, v in network.items()}
    params = tree.unflatten(flat)
    params["composition_weights"] = weights
    params["energy_scale"] = scale
    expected = expected_shapes(config)
    check_params(config, params, what=f"the weights of {source}", expected=expected)
    # reorder like init(), so that flatten() gives metatrain's state-dict order
    flat = tree.flatten(params)
    return tree.unflatten({k: flat[k] for k in expected})


def _unit_factor(from_unit: str, to_unit: str, label: str) -> float:
    """metatomic's conversion factor (what its ASE calculator multiplies by), so that
    a converted model agrees with metatomic's to round-off."""
    from metatomic.torch import unit_conversion_factor

    try:
        return float(unit_conversion_factor(from_unit, to_unit))
    except Exception as error:  # noqa: BLE001 - metatomic raises RuntimeError or ValueError
        raise ValueError(f"{label}: cannot convert its unit {from_unit!r} to {to_unit}: {error}") from None


def in_angstrom_and_ev(
    config: PETConfig,
    params,
    length_unit: str,
    energy_unit: str,
    label: str,
    uncertainty: dict | None = None,
):
    """``(config, params, uncertainty)`` of a metatrain model made to take Å and give eV.

    A metatrain model works in the units of its training data (its ``length_unit``
    and its energy target's ``unit``), and metatomic's calculator converts at the
    boundary. petfunc works in Å and eV throughout, so a model in other units is
    converted once, here, exactly (to round-off):

    * energy: E_eV = f E_model. The energy is ``c sum eps_i + sum w_Z``, so the scale c
      and the composition weights w are multiplied by f (and the LLPR multiplier and
      ensemble weights, which give energies too).
    * length: the model sees x_model = k x_Å. Lengths enter PET as the edge vectors
      and distances fed to each GNN layer's linear ``edge_embedder`` (whose weight is
      multiplied by k), and as distances compared with ``cutoff``, ``cutoff_width``
      and ``cutoff_width_adaptive`` (divided by k) in switching functions and the
      adaptive solver, which depend on ratios of lengths only. The ``grid`` adaptive
      method probes radii from a fixed 0.5 length units, and the long-range features
      are Coulomb potentials in the model's units, so those two are refused in
      lengths other than Å.
    """
    f = _unit_factor(energy_unit, "eV", label) if energy_unit not in ("", "eV") else 1.0
    k = _unit_factor("angstrom", length_unit, label) if length_unit not in ("", "angstrom") else 1.0
    if k != 1.0:
        where = f"{label} works in lengths of {length_unit!r}"
        if config.adaptive and config.adaptive_cutoff_method == "grid":
            raise ValueError(f"{where}; petfunc converts only Å models with the 'grid' adaptive cutoff")
        if config.long_range.enable:
            raise ValueError(f"{where}; petfunc converts only Å models with long-range features")
        config = dataclasses.replace(
            config,
            cutoff=config.cutoff / k,
            cutoff_width=config.cutoff_width / k,
            cutoff_width_adaptive=config.cutoff_width_adaptive / k,
        )
        flat = tree.flatten(params)
        for name, value in flat.items():
            # the geometric embedding [V_x, V_y, V_z, D] -> d_pet of every GNN layer,
            # and a LoRA adapter of it (W + s B A: A takes the input)
            if name.startswith(("gnn_layers.", "lora.gnn_layers.")) and name.endswith(
                (".edge_embedder.weight", ".edge_embedder.lora_A.weight")
            ):
                flat[name] = value * k
        params = tree.unflatten(flat)
    if f != 1.0:
        params = {
            **params,
            "composition_weights": params["composition_weights"] * f,
            "energy_scale": params["energy_scale"] * f,
        }
        if uncertainty is not None:
            uncertainty = {**uncertainty, "multiplier": uncertainty["multiplier"] * f}
            if "ensemble_weights" in uncertainty:
                uncertainty["ensemble_weights"] = uncertainty["ensemble_weights"] * f
    return config, params, uncertainty


def config_from_hypers(hypers: Mapping, atomic_types, source: str) -> PETConfig:
    hypers = dict(hypers)
    try:
        return PETConfig.from_hypers(hypers, atomic_types=[int(t) for t in atomic_types])
    except ValueError as error:
        raise ValueError(f"{source}: hypers petfunc cannot use: {error}") from error


def zbl_as_metatrain(config: PETConfig, energy_unit: str) -> PETConfig:
    """metatrain adds its ZBL repulsion only to energy targets whose unit is exactly
    ``"eV"`` (``ZBL.supports_target``); with any other unit, the empty default
    included, its PET has no ZBL term, whatever ``zbl`` says."""
    if config.zbl and energy_unit != "eV":
        return dataclasses.replace(config, zbl=False)
    return config


def to_metatrain_state_dict(params, config: PETConfig | None = None) -> dict[str, torch.Tensor]:
    """metatrain's ``backend.*`` state-dict entries for ``params`` (network weights only).

    With ``config`` the ``backend.species_to_species_index`` buffer is included too.
    The conditioning weights appear twice, as ``backend.system_conditioning.*`` and
    ``system_conditioning.*``: metatrain's PET aliases that module. The long-range
    weights keep metatrain's names, ``long_range_featurizer.*``. The composition
    weights and energy scale live in metatensor buffers (``additive_models.0.*``,
    ``scaler.*``); they are not part of this dict.
    """
    flat = tree.flatten(params)
    out: dict[str, torch.Tensor] = {}
    if config is not None:
        index = torch.full((max(config.atomic_types) + 1,), -1, dtype=torch.long)
        for i, t in enumerate(config.atomic_types):
            index[t] = i
        out["backend.species_to_species_index"] = index
    out.update(
        {
            k if k.startswith(LONG_RANGE_WEIGHTS) else f"backend.{k}": v
            for k, v in flat.items()
            if k not in EXTRA_KEYS
        }
    )
    out.update({k: v for k, v in flat.items() if k.startswith("system_conditioning.")})
    return out
