"""LLPR uncertainties (petfunc.llpr) against metatrain's LLPRUncertaintyModel, float64:
the shipped LLPR test checkpoints (every LLPR model version), random covariances
and ensemble weights on PETs with one and with three readout layers, and a model in
other units. The calculator's LLPR: tests/ase/test_llpr.py."""

import gzip
import os

import pytest
import torch


pytest.importorskip("metatrain")

import ase.build
from metatomic.torch import ModelOutput, System, systems_to_torch
from metatrain.llpr import LLPRUncertaintyModel
from metatrain.utils.io import model_from_checkpoint
from metatrain.utils.neighbor_lists import get_requested_neighbor_lists, get_system_with_neighbor_lists

import petfunc
from petfunc import llpr
from tests.helpers import mtt_reference as ref


CHECKPOINTS = ref.shipped_checkpoints("llpr")
SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


def _frames():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    cell = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    cell.rattle(0.05, seed=3)
    return [ethanol, cell]


def _metatrain_outputs(model, frames):
    """metatrain's energy, energy_uncertainty, energy_ensemble [S, K] and the
    position and strain gradients of every ensemble member."""
    systems = systems_to_torch(frames, dtype=torch.float64)
    requested = get_requested_neighbor_lists(model)
    positions, strains, inputs = [], [], []
    for system in systems:
        x = system.positions.clone().requires_grad_(True)
        eps = torch.eye(3, dtype=torch.float64, requires_grad=True)
        inputs.append(
            get_system_with_neighbor_lists(
                System(types=system.types, positions=x @ eps, cell=system.cell @ eps, pbc=system.pbc),
                requested,
            )
        )
        positions.append(x)
        strains.append(eps)
    outputs = {
        name: ModelOutput(quantity="energy", unit="eV", sample_kind="system")
        for name in ("energy", "energy_uncertainty", "energy_ensemble")
    }
    out = model(inputs, outputs)
    members = out["energy_ensemble"].block().values
    forces, strain = [], []
    for k in range(members.shape[1]):
        grads = torch.autograd.grad(members[:, k].sum(), positions + strains, retain_graph=True)
        forces.append(-torch.cat(grads[: len(frames)]))
        strain.append(torch.stack(grads[len(frames) :]))
    return (
        out["energy"].block().values[:, 0].detach(),
        out["energy_uncertainty"].block().values[:, 0].detach(),
        members.detach(),
        torch.stack(forces),
        torch.stack(strain),
    )


def _compare(config, params, uncertainty, model, frames):
    energy, sigma, members, member_forces, member_strain = _metatrain_outputs(model, frames)
    positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=torch.float64)
    e, s = llpr.energy_and_uncertainty(config)(params, uncertainty, positions, cell, neighbors)
    ens, forces, strain = llpr.ensemble(config, stress=True)(params, uncertainty, positions, cell, neighbors)
    torch.testing.assert_close(e, energy, rtol=1e-12, atol=1e-10)
    torch.testing.assert_close(s, sigma, rtol=1e-12, atol=0)
    torch.testing.assert_close(ens, members, rtol=1e-12, atol=1e-10)
    scale = member_forces.abs().max()
    assert (forces - member_forces).abs().max() <= 1e-11 * scale
    assert (strain - member_strain).abs().max() <= 1e-11 * member_strain.abs().max()


def test_all_llpr_checkpoints_found():
    assert len(CHECKPOINTS) == 9, CHECKPOINTS


@pytest.mark.parametrize("path", CHECKPOINTS, ids=[os.path.basename(p)[:-8] for p in CHECKPOINTS])
def test_llpr_checkpoint(path):
    """Energies, uncertainties, ensemble energies, forces and strain derivatives of
    every shipped LLPR checkpoint (LLPR model versions 2-4; the older ones hold the
    inverse covariance, which metatrain's upgrade turns into a Cholesky factor)."""
    config, params, uncertainty = llpr.from_metatrain(path, dtype=torch.float64)
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False, map_location="cpu")
    model = model_from_checkpoint(checkpoint, context="export").to(torch.float64).eval()
    # petfunc.from_metatrain reads the wrapped PET
    plain_config, plain = petfunc.from_metatrain(path, dtype=torch.float64)
    assert plain_config == config
    assert all(
        torch.equal(a, b)
        for a, b in zip(petfunc.tree.flatten(plain).values(), petfunc.tree.flatten(params).values())
    )
    _compare(config, params, uncertainty, model, _frames())


@pytest.mark.parametrize("featurizer, layers", [("feedforward", 2), ("residual", 3)])
def test_random_llpr(featurizer, layers):
    """A random covariance, multiplier and 5 ensemble members on a random PET: 32 or
    96 last-layer features, whose order (per readout layer: node, then edges) must
    be metatrain's for the uncertainty to agree."""
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 7, 8), featurizer_type=featurizer, num_gnn_layers=layers, **SMALL
    )
    params = petfunc.PET(config).init(seed=5, dtype=torch.float64)
    generator = torch.Generator().manual_seed(0)
    for value in petfunc.tree.flatten(params).values():
        value.copy_(torch.randn(value.shape, generator=generator, dtype=value.dtype) * 0.3)
    params["composition_weights"].zero_()
    params["energy_scale"].fill_(1.3)
    pet = ref.make_model(config)
    ref.load_params(pet, params)
    info = pet.dataset_info
    model = LLPRUncertaintyModel(hypers={"num_ensemble_members": {"energy": 5}}, dataset_info=info)
    model.set_wrapped_model(pet)
    model = model.to(torch.float64)
    features = model.ll_feat_size
    assert features == 2 * 16 * (layers if featurizer == "residual" else 1)
    a = torch.randn(features, features, generator=generator, dtype=torch.float64)
    uncertainty = {
        "cholesky": torch.linalg.cholesky(a @ a.T + features * torch.eye(features, dtype=torch.float64)),
        "multiplier": torch.tensor(2.5, dtype=torch.float64),
        "ensemble_weights": torch.randn(5, features, generator=generator, dtype=torch.float64),
    }
    state = model.state_dict()
    state["cholesky_energy_uncertainty"] = uncertainty["cholesky"]
    state["multiplier_energy_uncertainty"] = uncertainty["multiplier"].reshape(1)
    state["llpr_ensemble_layers.energy.weight"] = uncertainty["ensemble_weights"]
    model.load_state_dict(state)
    _compare(config, params, uncertainty, model.eval(), _frames() + [ase.build.molecule("CH3CONH2")])


def test_llpr_of_a_model_in_other_units():
    """An LLPR checkpoint of a model trained in meV: energies, uncertainties and
    ensemble members (energies and forces) come out in eV, 1e-3 times metatrain's."""
    path = CHECKPOINTS[-1]
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False, map_location="cpu")
    model = model_from_checkpoint(checkpoint, context="export").to(torch.float64).eval()
    info = checkpoint["wrapped_model_checkpoint"]["model_data"]["dataset_info"]
    info.targets["energy"].unit = "meV"
    config, params, uncertainty = llpr.from_metatrain(checkpoint, dtype=torch.float64)
    energy, sigma, members, member_forces, _ = _metatrain_outputs(model, _frames())
    positions, cell, neighbors = petfunc.from_atoms(_frames(), config, dtype=torch.float64)
    e, s = llpr.energy_and_uncertainty(config)(params, uncertainty, positions, cell, neighbors)
    ens, forces, _ = llpr.ensemble(config)(params, uncertainty, positions, cell, neighbors)
    torch.testing.assert_close(e, 1e-3 * energy, rtol=1e-12, atol=1e-13)
    torch.testing.assert_close(s, 1e-3 * sigma, rtol=1e-12, atol=0)
    torch.testing.assert_close(ens, 1e-3 * members, rtol=1e-12, atol=1e-13)
    assert (forces - 1e-3 * member_forces).abs().max() <= 1e-11 * member_forces.abs().max()
