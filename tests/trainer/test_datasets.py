"""The dataset files of a run: test sets, metatrain's indices, fractions below one
structure, reading a labelled file.
"""

import numpy as np
import pytest

from petfunc.cli import make_default_dataset
from petfunc.io import read_checkpoint
from petfunc.trainer import fit
from petfunc.trainer.options import parse_loss, resolve_options
from tests.helpers.trainer import TINY_MODEL, quiet, tiny_options


def test_test_set(dataset, tmp_path):
    """``test_set``: split off as mtt train does (stored in the checkpoint, kept on a
    restart), evaluated with the best model at the end: the RMSE equals one computed
    here with the calculator on those file indices; a separate file works too."""
    import ase.io

    from petfunc.ase import PETCalculator

    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    options["test_set"] = 0.25
    lines = []
    result = fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    assert any(
        "training set: 8 structures" in line
        and "validation set: 4 structures, test set: 4 structures" in line
        for line in lines
    ), lines
    split = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    test = split["test"][0]
    assert len(test) == 4 and sorted(split["training"][0] + split["validation"][0] + test) == list(range(16))
    frames = ase.io.read(dataset, ":")
    calc = PETCalculator(result.config, result.params)
    errors, forces = [], []
    for i in test:
        atoms = frames[i].copy()
        reference_e, reference_f = frames[i].get_potential_energy(), frames[i].get_forces()
        atoms.calc = calc
        errors.append((atoms.get_potential_energy() - reference_e) / len(atoms))
        forces.append(atoms.get_forces() - reference_f)
    assert result.test_errors["energy_per_atom_rmse"] == pytest.approx(
        np.sqrt(np.mean(np.square(errors))), rel=1e-9
    )
    assert result.test_errors["forces_rmse"] == pytest.approx(
        np.sqrt(np.mean(np.square(np.concatenate(forces)))), rel=1e-9
    )
    assert any(line.startswith("test set (4 structures)") for line in lines)
    assert (tmp_path / "run" / "parity_test.png").stat().st_size > 0

    # a restart keeps the test set of the run it continues
    options["architecture"]["training"]["num_epochs"] = 2
    lines = []
    fit(
        options,
        tmp_path / "restarted",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any("test set: 4 structures" in line for line in lines)
    assert read_checkpoint(tmp_path / "restarted" / "last.ckpt")["split"] == split

    # a separate test file; fractions that leave nothing to train on are an error
    options = tiny_options(dataset, num_epochs=1)
    ase.io.write(tmp_path / "test.xyz", frames[:3])
    options["test_set"] = str(tmp_path / "test.xyz")
    result = fit(options, None, progress=False, log=quiet())
    assert set(result.test_errors) >= {"energy_per_atom_rmse", "forces_rmse", "stress_rmse"}
    options["test_set"] = 0.75
    with pytest.raises(ValueError, match="'validation_set' and 'test_set' take all of the data"):
        fit(options, None, progress=False, log=quiet())
    options["test_set"] = [str(tmp_path / "test.xyz")] * 2
    with pytest.raises(ValueError, match="option 'test_set' lists 2 dataset"):
        fit(options, None, progress=False, log=quiet())

    # the test set does not add atomic types to the model (as in metatrain): a type
    # only it has is an error before training; one only the validation set has is
    # a type of the model, with a warning
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    odd = frames[0].copy()
    odd.numbers[0] = 47
    odd.calc = EMT()
    odd.calc = SinglePointCalculator(
        odd, energy=odd.get_potential_energy(), forces=odd.get_forces(), stress=odd.get_stress()
    )
    ase.io.write(tmp_path / "silver.xyz", [odd])
    options["test_set"] = str(tmp_path / "silver.xyz")
    with pytest.raises(ValueError, match=r"the test set has atomic type\(s\) \[47\] that the model lacks"):
        fit(options, tmp_path / "silver", progress=False, log=quiet())
    assert not (tmp_path / "silver" / "last.ckpt").exists()
    options["test_set"], options["validation_set"] = None, str(tmp_path / "silver.xyz")
    lines = []
    result = fit(options, None, progress=False, log=quiet(lines))
    assert 47 in result.config.atomic_types
    assert any("atomic type(s) [47] appear in the validation set only" in line for line in lines)


def test_explicit_indices_equal_mtt_train(tmp_path):
    """metatrain's ``indices``: a training subset split by fractions, and
    validation/test sets given as indices into the training file. Regression values:
    indices/{training,validation,test}.txt of ``mtt train`` (metatrain 2026.4.1,
    seed 7, 21 structures) with the same options."""
    from petfunc.trainer.datasets import read_training_files

    data = make_default_dataset(tmp_path / "data.xyz", n_structures=21, seed=1)
    subset = [20, 3, 5, 7, 9, 11, 13, 15, 2, 0, 1, 18, 17, 16]
    (tmp_path / "subset.txt").write_text("\n".join(map(str, subset)) + "\n")

    def split(**options):
        resolved = resolve_options(
            {"seed": 7, "training_set": {"systems": str(data), "indices": subset}, **options}
        )
        weights, explicit = parse_loss(resolved["architecture"]["training"]["loss"])
        split = read_training_files(resolved, weights, explicit, 7, None, quiet()).split
        for key in ("digests", "validation_digests", "test_digests"):
            split.pop(key)
        return split

    assert split(validation_set=0.3, test_set=0.2) == {
        "training": [[18, 11, 5, 3, 1, 17, 20, 16]],
        "validation": [[7, 13, 0, 9]],
        "test": [[2, 15]],
    }
    assert split(validation_set={"indices": [4, 6, 8]}, test_set={"indices": str(tmp_path / "subset.txt")})[
        "test"
    ] == [subset]
    assert split(validation_set={"indices": [4, 6, 8]}, test_set={"indices": [10, 12, 14, 19]}) == {
        "training": [subset],
        "validation": [[4, 6, 8]],
        "test": [[10, 12, 14, 19]],
    }
    with pytest.raises(
        ValueError, match=r"option 'validation_set.indices': index 21 is out of range for a file of 21"
    ):
        split(validation_set={"indices": [21]})
    with pytest.raises(ValueError, match=r"option 'training_set.indices': indices must not repeat"):
        resolve_options({"training_set": {"systems": str(data), "indices": [1, 1]}})
    with pytest.raises(ValueError, match=r"indices alone need a single training dataset"):
        resolve_options({"training_set": [str(data), str(data)], "validation_set": {"indices": [1]}})
    # a run and its restart keep the split
    options = tiny_options(data, num_epochs=1)
    options["training_set"] = {"systems": str(data), "indices": subset}
    options["validation_set"] = {"indices": [4, 6, 8]}
    first = fit(options, tmp_path / "run", progress=False, log=quiet())
    stored = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    assert stored["validation"] == [[4, 6, 8]] and sorted(stored["training"][0]) == sorted(subset)
    options["architecture"]["training"]["num_epochs"] = 2
    again = fit(
        options, tmp_path / "again", restart=tmp_path / "run" / "last.ckpt", progress=False, log=quiet()
    )
    assert read_checkpoint(tmp_path / "again" / "last.ckpt")["split"] == stored
    assert first.history[0]["val_loss"] == again.history[0]["val_loss"]
    options["validation_set"] = {"indices": [4, 6]}  # a restart cannot change its split
    with pytest.raises(
        ValueError, match=r"option 'validation_set' is indices \[4, 6\] here, indices \[4, 6, 8\]"
    ):
        fit(options, tmp_path / "third", restart=tmp_path / "run" / "last.ckpt", progress=False, log=quiet())


def test_validation_fraction_below_one_structure(dataset):
    """As in metatrain: floor(16 * 0.05) = 0 validation structures, with a warning;
    the run trains and reports training metrics."""
    lines = []
    result = fit(
        tiny_options(dataset, num_epochs=1) | {"validation_set": 0.05}, None, progress=False, log=quiet(lines)
    )
    assert any("is less than one; none of them is used for validation" in line for line in lines), lines
    assert any("training set: 16 structures" in line for line in lines), lines
    assert result.best_epoch == 1


def test_read_dataset(dataset, tmp_path):
    """petfunc.read_dataset: labels as in the file (eV, eV/Å), a slice, clear errors."""
    import ase.io

    import petfunc

    frames = ase.io.read(dataset, ":")
    config = petfunc.PETConfig(atomic_types=(13, 28, 29), **TINY_MODEL)
    data = petfunc.read_dataset(dataset, config)
    assert len(data.samples) == len(frames) == 16
    assert data.samples[3].energy == frames[3].get_potential_energy()
    np.testing.assert_array_equal(data.samples[3].forces, frames[3].get_forces())
    assert len(petfunc.read_dataset(dataset, config, index="2:5").samples) == 3
    with pytest.raises(FileNotFoundError, match="dataset: dataset file not found: .*nope.xyz"):
        petfunc.read_dataset(tmp_path / "nope.xyz", config)
    (tmp_path / "bad.xyz").write_text("not an xyz file\n")
    with pytest.raises(ValueError, match="could not read dataset file"):
        petfunc.read_dataset(tmp_path / "bad.xyz", config)
