"""Training data as metatrain handles it: the composition weights and energy scale
it fits, its validation and test splits, several training files, and its
batches of at most ``max_atoms`` atoms."""

import ase
import ase.build
import numpy as np
import pytest
import torch


pytest.importorskip("metatrain")

import petfunc
from tests.helpers import mtt_reference as ref
from tests.helpers.parity import SMALL


def _emt_molecules(n, names, seed):
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    noise = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        atoms = ase.build.molecule(names[i % len(names)])
        atoms.rattle(0.05, seed=100 * seed + i)
        atoms.calc = EMT()
        energy = atoms.get_potential_energy() + 0.1 * noise.normal()
        atoms.calc = SinglePointCalculator(atoms, energy=energy)
        frames.append(atoms)
    return frames


@pytest.mark.parametrize(
    "names", [("CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H6"), ("CH3CH2OH",)], ids=["mixed", "collinear"]
)
@pytest.mark.parametrize("batch_size", [16, 5])
def test_composition_and_scale_equal_metatrain(tmp_path, names, batch_size):
    """Bitwise the weights and scale of metatrain's composition model and scaler
    (train_or_load_*), with a species absent from the data. Every structure being
    C2H6O makes the fit singular: the 1e-14 ridge then decides the weights (they
    differ by ~1e-2 with another ridge), so it must be metatrain's."""
    import ase.io
    import metatensor.torch as mts
    from metatrain.composition import train_or_load_composition_model
    from metatrain.scaler import train_or_load_scaler
    from metatrain.utils.data import get_dataset
    from omegaconf import OmegaConf

    from petfunc.data import fit_composition, fit_scale, sample_from_atoms

    frames = _emt_molecules(37, names, seed=batch_size)
    path = str(tmp_path / "data.xyz")
    ase.io.write(path, frames)
    target = {
        "quantity": "energy",
        "read_from": path,
        "reader": None,
        "key": "energy",
        "unit": "eV",
        "per_atom": False,
        "type": "scalar",
        "num_subtargets": 1,
        "description": "",
        "forces": False,
        "stress": False,
        "virial": False,
    }
    dataset, _, _ = get_dataset(
        OmegaConf.create(
            {
                "systems": {"read_from": path, "reader": None, "length_unit": "angstrom"},
                "targets": {"energy": target},
            }
        )
    )
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8, 14), **SMALL)
    model = ref.make_model(config)
    train_or_load_composition_model(model.additive_models[0], {}, [dataset], [], batch_size, False)
    train_or_load_scaler(model.scaler, [dataset], model.additive_models, batch_size, False)
    expected_w = mts.load_buffer(model.additive_models[0].energy_composition_buffer).block().values.flatten()
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]

    samples = [
        sample_from_atoms(a, config, energy_key="energy", forces_key=None, stress_key=None) for a in frames
    ]
    w = fit_composition(samples, config.num_species, batch_size)
    assert np.array_equal(w, expected_w.numpy()), (w, expected_w)
    assert w[-1] == 0.0  # Si never appears
    assert fit_scale(samples, w) == pytest.approx(float(expected_c), rel=1e-14)
    # per_structure_targets: [energy]: the RMS of the per-structure residual
    model = ref.make_model(config)
    train_or_load_composition_model(model.additive_models[0], {}, [dataset], [], batch_size, False)
    train_or_load_scaler(
        model.scaler, [dataset], model.additive_models, batch_size, False, per_structure_targets=["energy"]
    )
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]
    assert fit_scale(samples, w, per_atom=False) == pytest.approx(float(expected_c), rel=1e-14)
    assert abs(fit_scale(samples, w, per_atom=False) / fit_scale(samples, w) - 1) > 0.5  # a different scale


def test_validation_split_equals_mtt_train():
    """Regression values from ``mtt train`` (metatrain 2026.4.1, seed 7, 21 structures,
    ``validation_set: 0.3``, default ``test_set: 0``): its indices/training.txt and
    validation.txt, in their order."""
    from petfunc.data.splits import split_datasets, split_indices

    train, val = split_indices(21, 0.3, seed=7)
    assert train.tolist() == [20, 5, 11, 2, 0, 8, 1, 12, 19, 16, 6, 13, 9, 10, 18]
    assert val.tolist() == [17, 14, 7, 3, 4, 15]
    # a separate validation file: metatrain's test split still reshuffles the training set
    train, val = split_indices(5, None, seed=7)
    assert sorted(train.tolist()) == list(range(5)) and len(val) == 0
    # a fraction below 1/n: no validation structure (metatrain warns, so does petfunc)
    train, val = split_indices(5, 0.1, seed=7)
    assert sorted(train.tolist()) == list(range(5)) and len(val) == 0
    # two training files (21 and 18 structures), seed 7, validation_set: 0.3:
    # indices/training_{0,1}.txt and validation_{0,1}.txt of that mtt train run
    (t0, v0, _), (t1, v1, _) = split_datasets([21, 18], 0.3, seed=7)
    assert t0.tolist() == [6, 13, 11, 16, 12, 18, 9, 2, 20, 19, 0, 10, 8, 5, 1]
    assert v0.tolist() == [17, 14, 7, 3, 4, 15]
    assert t1.tolist() == [10, 11, 16, 0, 14, 6, 1, 2, 17, 3, 13, 4, 9]
    assert v1.tolist() == [7, 15, 8, 5, 12]
    # with a test set: the training, validation and test .txt of mtt train runs
    # (seed 7) with validation_set: 0.3 and test_set: 0.2 (one file of 21)...
    ((train, val, test),) = split_datasets([21], 0.3, seed=7, test_fraction=0.2)
    assert train.tolist() == [20, 5, 11, 2, 0, 8, 1, 12, 19, 16, 6]
    assert val.tolist() == [17, 14, 7, 3, 4, 15] and test.tolist() == [13, 9, 10, 18]
    # ... test_set: 0.15 of two files (21 and 18) ...
    (t0, v0, s0), (t1, v1, s1) = split_datasets([21, 18], 0.3, seed=7, test_fraction=0.15)
    assert t0.tolist() == [6, 13, 11, 16, 12, 18, 9, 2, 20, 19, 0, 10] and s0.tolist() == [8, 5, 1]
    assert t1.tolist() == [10, 11, 16, 0, 14, 6, 1, 2, 17, 3, 13] and s1.tolist() == [4, 9]
    assert v0.tolist() == [17, 14, 7, 3, 4, 15] and v1.tolist() == [7, 15, 8, 5, 12]
    # ... and a separate validation file with test_set: 0.25
    ((train, val, test),) = split_datasets([21], None, seed=7, test_fraction=0.25)
    assert train.tolist() == [1, 5, 2, 18, 11, 13, 0, 19, 6, 20, 16, 12, 10, 9, 8, 17]
    assert val.tolist() == [] and test.tolist() == [14, 7, 3, 4, 15]


def test_several_training_files(tmp_path):
    """``training_set`` as a list of files, one without forces and stresses: the fitted
    composition and scale equal metatrain's (train_or_load_* on the same split of
    each file, batched per file), the split is metatrain's, and the file without
    forces trains with NaN force labels (skipped by the loss)."""
    import ase.io
    import metatensor.torch as mts
    from metatrain.composition import train_or_load_composition_model
    from metatrain.scaler import train_or_load_scaler
    from metatrain.utils.data import get_dataset
    from omegaconf import OmegaConf
    from torch.utils.data import Subset

    from petfunc.cli import make_default_dataset
    from petfunc.data.splits import split_datasets
    from petfunc.trainer import fit

    first = make_default_dataset(tmp_path / "cells.xyz", n_structures=11, seed=1)
    frames = ase.io.read(make_default_dataset(tmp_path / "more.xyz", n_structures=9, seed=2), ":")
    for atoms in frames:
        atoms.calc = type(atoms.calc)(atoms, energy=atoms.get_potential_energy())
    second = tmp_path / "energies.xyz"
    ase.io.write(second, frames)
    batch_size = 4
    options = {
        "seed": 5,
        "architecture": {
            "name": "pet",
            "model": dict(
                SMALL,
                d_pet=8,
                d_node=8,
                d_head=8,
                d_feedforward=8,
                num_gnn_layers=1,
                num_attention_layers=1,
                cutoff=3.0,
            ),
            "training": {"batch_size": batch_size, "num_epochs": 1},
        },
        "training_set": [str(first), {"systems": str(second), "targets": {"energy": {"key": "energy"}}}],
        "validation_set": 0.25,
    }
    lines = []
    result = fit(options, None, progress=False, log=lines.append)
    assert any(
        "training set: 16 structures" in line and "validation set: 4 structures" in line for line in lines
    ), lines
    # batches of one file each, as metatrain's combined loader: 9 // 4 + 7 // 4 = 3
    # steps (batches mixing the files would make 16 // 4 = 4)
    assert any("3 steps per epoch" in line for line in lines), lines
    assert np.isfinite(result.history[-1]["train_loss"]), result.history[-1]

    subsets = []
    for path, (train, _, _) in zip((first, second), split_datasets([11, 9], 0.25, seed=5)):
        target = {
            "quantity": "energy",
            "read_from": str(path),
            "reader": None,
            "key": "energy",
            "unit": "eV",
            "per_atom": False,
            "type": "scalar",
            "num_subtargets": 1,
            "description": "",
            "forces": False,
            "stress": False,
            "virial": False,
        }
        dataset, _, _ = get_dataset(
            OmegaConf.create(
                {
                    "systems": {"read_from": str(path), "reader": None, "length_unit": "angstrom"},
                    "targets": {"energy": target},
                }
            )
        )
        subsets.append(Subset(dataset, train.tolist()))
    model = ref.make_model(result.config)
    train_or_load_composition_model(model.additive_models[0], {}, subsets, [], batch_size, False)
    train_or_load_scaler(model.scaler, subsets, model.additive_models, batch_size, False)
    expected_w = mts.load_buffer(model.additive_models[0].energy_composition_buffer).block().values.flatten()
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]
    assert torch.equal(result.params["composition_weights"], expected_w)
    assert float(result.params["energy_scale"]) == pytest.approx(float(expected_c), rel=1e-14)

    # one validation file per training file, or an error that says so
    options["validation_set"] = [str(second)]
    with pytest.raises(ValueError, match="lists 1 dataset.*'training_set' lists 2"):
        fit(options, None, progress=False, log=quiet_log)
    options["validation_set"] = 0.25
    options["training_set"][1] = str(tmp_path / "missing.xyz")
    with pytest.raises(FileNotFoundError, match=r"training_set\[1\]: dataset file not found"):
        fit(options, None, progress=False, log=quiet_log)


def quiet_log(message):
    pass


def test_max_atoms_per_batch_equals_metatrain_sampler():
    """``max_atoms_per_batch``: the batches of every epoch (and of each of 2 ranks)
    are those of metatrain's ``MaxAtomDistributedBatchSampler`` on the same atom
    counts, with and without ``min_atoms``, oversized structures skipped."""
    from metatrain.utils.data.samplers import MaxAtomDistributedBatchSampler

    from petfunc.data.batching import batch_plan

    class Counts(torch.utils.data.Dataset):
        def __init__(self, counts):
            self.counts = counts

        def __len__(self):
            return len(self.counts)

        def get_num_atoms(self, i):
            return int(self.counts[i])

    counts = np.random.default_rng(4).integers(1, 40, size=57)
    counts[[3, 30]] = 70  # larger than max_atoms: skipped in training
    for max_atoms, min_atoms, world in ((64, 0, 1), (64, 30, 1), (100, 0, 2), (41, 10, 3)):
        for rank in range(world):
            sampler = MaxAtomDistributedBatchSampler(
                Counts(counts),
                max_atoms,
                num_replicas=world,
                rank=rank,
                shuffle=True,
                drop_last=True,
                min_atoms=min_atoms,
            )
            for epoch in (0, 1, 5):
                sampler.set_epoch(epoch)
                expected = [list(b) for b in sampler]
                plan = batch_plan(
                    len(counts),
                    8,
                    epoch=epoch,
                    seed=123,
                    rank=rank,
                    world_size=world,
                    atom_counts=counts,
                    max_atoms=max_atoms,
                    min_atoms=min_atoms,
                )
                assert [b.tolist() for b in plan] == expected, (max_atoms, min_atoms, world, rank, epoch)
    # evaluation keeps every structure once, an oversized one alone
    plan = batch_plan(len(counts), 8, shuffle=False, drop_last=False, atom_counts=counts, max_atoms=64)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(counts)))
    assert [3] in [b.tolist() for b in plan] and all(counts[b].sum() <= 64 for b in plan if len(b) > 1)
