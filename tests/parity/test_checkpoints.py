"""``from_metatrain`` reproduces every checkpoint shipped with metatrain's PET tests:
energies, per-atom energies, forces and strain derivatives of metatrain's model."""

import gzip
import os

import pytest
import torch


pytest.importorskip("metatrain")

from metatrain.utils.io import model_from_checkpoint

import petfunc
from tests.helpers import mtt_reference as ref
from tests.helpers.parity import CHECKPOINTS, assert_close, composition, cubic_cell, molecules


def _checkpoint_id(path):
    return os.path.basename(path).replace(".ckpt.gz", "")


def test_all_checkpoints_found():
    names = {_checkpoint_id(p) for p in CHECKPOINTS}
    assert len(CHECKPOINTS) == 34, sorted(names)
    assert {"model-v1_trainer-v1", "model-v8_trainer-v7", "model-v16_trainer-v15"} <= names


@pytest.mark.parametrize("path", CHECKPOINTS, ids=[_checkpoint_id(p) for p in CHECKPOINTS])
def test_checkpoint(path):
    config, params = petfunc.from_metatrain(path, dtype=torch.float64)
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False, map_location="cpu")
    mtt = model_from_checkpoint(checkpoint, context="export").to(torch.float64).eval()
    assert list(mtt.atomic_types) == list(config.atomic_types)
    compare_checkpoint = [molecules()[0], cubic_cell()]
    assert config.system_conditioning == ("conditioning" in os.path.basename(path))
    if config.system_conditioning:
        compare_checkpoint[0].info.update(charge=-1, spin_multiplicity=2)
        compare_checkpoint[1].info.update(charge=2, spin=3)
    energy, per_atom, forces, strain = ref.evaluate(mtt, compare_checkpoint)

    model = petfunc.PET(config)
    positions, cell, neighbors = petfunc.from_atoms(compare_checkpoint, config, dtype=torch.float64)
    e, f, w = petfunc.energy_forces_strain_derivative(model.energy)(params, positions, cell, neighbors)
    pa = model.per_atom_energies(params, positions, cell, neighbors)
    comp_atoms, comp_total = composition(params, compare_checkpoint, config)
    # the tiny checkpoints' network energies are small next to the composition: compare
    # the totals relative to themselves too
    assert_close(e, energy, "energy")
    assert_close(e - comp_total, energy - comp_total, "energy - composition", rtol=1e-9)
    assert_close(pa - comp_atoms, per_atom - comp_atoms, "per-atom energy - composition", rtol=1e-9)
    assert_close(f, forces, "forces")
    assert_close(w, strain, "dE/dstrain")
