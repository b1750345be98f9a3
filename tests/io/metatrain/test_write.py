"""to_metatrain / save_metatrain: petfunc's model as the checkpoint metatrain's trainer
writes, read back bitwise by from_metatrain and accepted by metatrain's own loaders,
``mtt export`` and ``mtt train --restart``."""

import subprocess
import sys

import pytest
import torch


pytest.importorskip("metatrain")

from metatrain.pet import PET as MetatrainPET
from metatrain.pet.trainer import Trainer
from metatrain.utils.architectures import get_default_hypers
from metatrain.utils.io import model_from_checkpoint, trainer_from_checkpoint

import petfunc
from petfunc.io.metatrain import from_metatrain, save_metatrain, to_metatrain
from tests.helpers.metatomic_export import KINDS, config_of, params_of, results, structures


def assert_same_model(config, params, other_config, other_params):
    """Equal configs and bitwise-equal parameters, in the same order and dtypes."""
    assert other_config == config
    flat, other = petfunc.tree.flatten(params), petfunc.tree.flatten(other_params)
    assert list(other) == list(flat)
    for name, value in flat.items():
        assert other[name].dtype == value.dtype, name
        assert torch.equal(other[name], value), name


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_is_bitwise(kind):
    config = config_of(kind)
    params = params_of(kind, config)
    assert_same_model(config, params, *from_metatrain(to_metatrain(config, params)))


def test_round_trip_float32():
    """float32 weights stay float32; the composition and scale stay float64."""
    config = config_of("default")
    params = petfunc.io.cast_params(params_of("default", config), torch.float32, "cpu")
    checkpoint = to_metatrain(config, params)
    assert checkpoint["model_state_dict"]["backend.edge_embedder.weight"].dtype == torch.float32
    assert_same_model(config, params, *from_metatrain(checkpoint))
    # and on request
    wide = to_metatrain(config, params, dtype=torch.float64)
    assert wide["model_state_dict"]["backend.edge_embedder.weight"].dtype == torch.float64


def test_checkpoint_is_metatrains(tmp_path):
    """The entries and versions metatrain's trainer writes; the file reads back in
    petfunc's no-code unpickler, and in metatrain's loaders for export and restart."""
    config = config_of("ZBL")
    params = params_of("ZBL", config)
    path = tmp_path / "model.ckpt"
    save_metatrain(config, params, path)
    assert_same_model(config, params, *petfunc.load_model(path))

    checkpoint = torch.load(path, weights_only=False)
    assert checkpoint["architecture_name"] == "pet"
    assert checkpoint["model_ckpt_version"] == MetatrainPET.__checkpoint_version__
    assert checkpoint["trainer_ckpt_version"] == Trainer.__checkpoint_version__
    info = checkpoint["model_data"]["dataset_info"]
    assert info.length_unit == "angstrom" and list(info.atomic_types) == list(config.atomic_types)
    assert info.targets["energy"].unit == "eV" and info.targets["energy"].quantity == "energy"
    for context in ("export", "restart"):
        model = model_from_checkpoint(torch.load(path, weights_only=False), context=context)
        assert isinstance(model, MetatrainPET)
    hypers = get_default_hypers("pet")["training"]
    trainer = trainer_from_checkpoint(torch.load(path, weights_only=False), context="restart", hypers=hypers)
    assert isinstance(trainer, Trainer) and trainer.epoch is None


def test_mtt_export_of_the_checkpoint(tmp_path):
    """``mtt export`` (its Python entry) of the checkpoint gives a metatomic model equal
    to petfunc's calculator on a periodic cell."""
    pytest.importorskip("metatomic_ase")
    from metatomic_ase import MetatomicCalculator
    from metatrain.cli.export import export_model

    config = config_of("default")
    params = params_of("default", config)
    save_metatrain(config, params, tmp_path / "model.ckpt")
    export_model(tmp_path / "model.ckpt", tmp_path / "model.pt")
    atoms = structures()["periodic cell"]
    got = results(MetatomicCalculator(str(tmp_path / "model.pt"), device="cpu"), atoms)
    expected = results(petfunc.ase.PETCalculator(config, params), atoms)
    for name, value in expected.items():
        assert abs(got[name] - value).max() <= 1e-10 * abs(value).max(), name


def test_refusals():
    config = config_of("default")
    params = params_of("default", config)
    with pytest.raises(ValueError, match=r"LoRA adapters .*petfunc.lora.merge"):
        to_metatrain(config, petfunc.lora.attach(params, rank=2))
    with pytest.raises(ValueError, match="do not match the config"):
        to_metatrain(petfunc.PETConfig(atomic_types=(1, 6, 8, 9)), params)
    with pytest.raises(ValueError, match="float32 or float64"):
        to_metatrain(config, params, dtype=torch.float16)
    with pytest.raises(TypeError, match="PETConfig"):
        to_metatrain(config.to_hypers(), params)


@pytest.mark.slow
def test_mtt_train_restarts_from_the_checkpoint(tmp_path):
    """``mtt train options.yaml --restart model.ckpt`` trains on from the weights."""
    import ase.build
    import ase.io
    import numpy as np

    config = config_of("default")
    save_metatrain(config, params_of("default", config), tmp_path / "model.ckpt")
    frames = []
    for i, name in enumerate(["CH4", "H2O", "CH3OH", "C2H6"]):
        atoms = ase.build.molecule(name)
        atoms.center(vacuum=3.0)
        atoms.info["energy"] = -float(i)
        atoms.arrays["forces"] = np.zeros((len(atoms), 3))
        frames.append(atoms)
    ase.io.write(tmp_path / "data.xyz", frames)
    (tmp_path / "options.yaml").write_text(
        "architecture:\n  name: pet\n  training:\n    num_epochs: 1\n    batch_size: 2\n"
        "training_set:\n  systems:\n    read_from: data.xyz\n    length_unit: angstrom\n"
        "  targets:\n    energy:\n      key: energy\n      unit: eV\n"
        "test_set: 0.0\nvalidation_set: 0.5\n"
    )
    command = [sys.executable, "-m", "metatrain", "train", "options.yaml", "--restart", "model.ckpt"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    log = next(tmp_path.glob("outputs/*/*/train.log")).read_text()
    assert "Restarting training from 'model.ckpt'" in log
    assert (tmp_path / "model.pt").is_file()
