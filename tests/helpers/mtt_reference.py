"""Reference evaluations with metatrain's own eager PET (test helper).

Imported only by tests that ``pytest.importorskip("metatrain")``.
"""

from __future__ import annotations

import copy
import glob
import os

import metatensor.torch as mts
import torch
from metatomic.torch import ModelOutput, System, systems_to_torch
from metatrain.pet import PET as MttPET
from metatrain.utils.architectures import get_default_hypers
from metatrain.utils.data import DatasetInfo
from metatrain.utils.data.target_info import get_energy_target_info
from metatrain.utils.neighbor_lists import (
    get_requested_neighbor_lists,
    get_system_with_neighbor_lists,
)

import petfunc


def make_model(config: petfunc.PETConfig, length_unit: str = "angstrom", energy_unit: str = "eV"):
    """A metatrain PET with the architecture of ``config`` (float64, eval mode), whose
    dataset was in ``length_unit`` and ``energy_unit`` (its cutoffs are in
    ``length_unit``, as metatrain reads them)."""
    hypers = copy.deepcopy(get_default_hypers("pet")["model"])
    for key, value in config.to_hypers().items():
        if key == "atomic_types":
            continue
        if key == "long_range":
            hypers["long_range"].update(value)
            continue
        hypers[key] = value
    nu = hypers["num_neighbors_adaptive"]
    if nu is not None:
        # metatrain's options type it as an int; its model computes with any number,
        # so a fractional one is passed on as it is (int() would compare with another nu)
        hypers["num_neighbors_adaptive"] = int(nu) if float(nu).is_integer() else float(nu)
    targets = {"energy": get_energy_target_info("energy", {"quantity": "energy", "unit": energy_unit})}
    info = DatasetInfo(length_unit=length_unit, atomic_types=list(config.atomic_types), targets=targets)
    model = MttPET(hypers, info)
    return model.to(torch.float64).eval()


def set_composition_and_scale(model, weights, scale):
    """Write composition weights [n_types] and an energy scale into metatrain's buffers."""
    comp = model.additive_models[0]
    tm = comp.model.weights["energy"]
    block = tm.block()
    values = torch.as_tensor(weights, dtype=block.values.dtype).reshape(block.values.shape)
    new_block = mts.TensorBlock(values, block.samples, block.components, block.properties)
    comp.model.weights["energy"] = mts.TensorMap(tm.keys, [new_block])
    comp.energy_composition_buffer = mts.save_buffer(mts.make_contiguous(comp.model.weights["energy"])).to(
        comp.energy_composition_buffer.device
    )
    scaler = model.scaler
    for name in ("energy_scaler_buffer", "energy_per_target_scaler_buffer"):
        buf = getattr(scaler, name)
        t = mts.load_buffer(buf)
        b = t.block()
        vals = torch.full_like(b.values, float(scale))
        t = mts.TensorMap(t.keys, [mts.TensorBlock(vals, b.samples, b.components, b.properties)])
        setattr(scaler, name, mts.save_buffer(mts.make_contiguous(t)))
    scaler.sync_tensor_maps()
    comp.sync_tensor_maps()


def load_params(model, params):
    """Copy a petfunc parameter tree into a metatrain model (composition and scale too)."""
    flat = petfunc.tree.flatten(params)
    weights = flat.pop("composition_weights")
    scale = flat.pop("energy_scale")
    state = {
        k if k.startswith(petfunc.io.LONG_RANGE_WEIGHTS) else f"backend.{k}": v.detach().to(torch.float64)
        for k, v in flat.items()
    }
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k.startswith("backend.") and k != "backend.species_to_species_index"]
    assert not missing and not unexpected, (missing, unexpected)
    set_composition_and_scale(model, weights.double(), float(scale))


def add_system_data(model, system, atoms):
    """Attach the per-system inputs the model requests (charge, spin multiplicity)
    from ``atoms.info``, as metatomic's ASE calculator reads them."""
    from metatensor.torch import Labels, TensorBlock, TensorMap

    # a wrapper (LLPR) forwards its inputs to the wrapped model
    requested = (
        model.requested_inputs() if hasattr(model, "requested_inputs") else model.model.requested_inputs()
    )
    for name in requested:
        if name == "charge":
            value = float(atoms.info.get("charge", 0))
        elif name == "spin_multiplicity":
            value = float(atoms.info.get("spin_multiplicity", atoms.info.get("spin", 1)))
        else:
            raise ValueError(f"unknown requested input {name!r}")
        block = TensorBlock(
            values=torch.tensor([[value]], dtype=system.positions.dtype),
            samples=Labels(["system"], torch.zeros((1, 1), dtype=torch.int32)),
            components=[],
            properties=Labels([name], torch.zeros((1, 1), dtype=torch.int32)),
        )
        system.add_data(name, TensorMap(Labels.single(), [block]))
    return system


def evaluate(model, frames, stress: bool = True):
    """Energies [S], per-atom energies [N], forces [N, 3], strain derivative [S, 3, 3]."""
    systems = systems_to_torch(frames, dtype=torch.float64)
    # every list the model and its submodules ask for (ZBL has its own)
    requested = get_requested_neighbor_lists(model)
    strains = []
    new_systems = []
    positions = []
    for system in systems:
        strain = torch.eye(3, dtype=torch.float64, requires_grad=True)
        pos = system.positions.clone().requires_grad_(True)
        s = System(types=system.types, positions=pos @ strain, cell=system.cell @ strain, pbc=system.pbc)
        s = get_system_with_neighbor_lists(s, requested)
        add_system_data(model, s, frames[len(new_systems)])
        strains.append(strain)
        positions.append(pos)
        new_systems.append(s)
    out = model(
        new_systems,
        {"energy": ModelOutput(quantity="energy", unit="eV", sample_kind="system")},
    )
    energies = out["energy"].block().values[:, 0]
    grads = torch.autograd.grad(energies.sum(), positions + strains)
    forces = -torch.cat(grads[: len(frames)])
    de_deps = torch.stack(grads[len(frames) :])
    per_atom = (
        model(
            list(new_systems),
            {"energy": ModelOutput(quantity="energy", unit="eV", sample_kind="atom")},
        )["energy"]
        .block()
        .values[:, 0]
    )
    return energies.detach(), per_atom.detach(), forces.detach(), de_deps.detach()


def shipped_checkpoints(package: str) -> list[str]:
    """The checkpoints (``*.ckpt.gz``) shipped with the tests of metatrain's ``package``
    (``"pet"``, ``"llpr"``), sorted."""
    module = __import__(f"metatrain.{package}", fromlist=["_"])
    return sorted(
        glob.glob(os.path.join(os.path.dirname(module.__file__), "tests", "checkpoints", "*.ckpt.gz"))
    )
