"""Reading metatrain's exported models (petfunc.io.metatrain.exported): the
weights and hypers of the checkpoint, long-range settings included, float32 hypers
read as written."""

import gzip

import pytest
import torch

import petfunc
from tests.helpers.io_setup import (
    assert_same_params,
    metatrain_checkpoint,
    metatrain_reference,
    small_config,
    small_params,
)


def test_from_metatrain_exported_model(tmp_path):
    metatrain_reference()
    from metatrain.utils.io import model_from_checkpoint

    path = metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz")
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False)
    model_from_checkpoint(checkpoint, "export").export().save(str(tmp_path / "model.pt"))
    config, params = petfunc.from_metatrain(tmp_path / "model.pt")
    config_ck, params_ck = petfunc.from_metatrain(path)
    assert config == config_ck
    assert_same_params(params, params_ck)


def test_from_metatrain_exported_long_range_model(tmp_path):
    """The long-range settings and weights of an exported model are read back."""
    ref = metatrain_reference()
    pytest.importorskip("torchpme")
    from metatrain.utils.io import model_from_checkpoint

    config = small_config(
        long_range=dict(
            enable=True, use_ewald=True, smearing=1.1, kspace_resolution=0.9, interpolation_nodes=4
        )
    )
    params = small_params(config)
    model = ref.make_model(config)
    ref.load_params(model, params)
    model_from_checkpoint(model.get_checkpoint(), "export").export().save(str(tmp_path / "model.pt"))
    loaded_config, loaded = petfunc.from_metatrain(tmp_path / "model.pt")
    assert loaded_config == config
    assert_same_params(loaded, params)


def test_float32_hypers_of_an_export_read_as_written():
    """An exported float32 long-range model keeps its smearing as a float32 tensor;
    read back as 1.100000023841858 its config would differ from the checkpoint's."""
    from petfunc.io.metatrain.exported import as_written

    assert as_written(torch.tensor(1.1, dtype=torch.float32)) == 1.1
    assert as_written(torch.tensor(0.9, dtype=torch.float32)) == 0.9
    assert as_written(torch.tensor(1.1, dtype=torch.float64)) == 1.1
    assert as_written(torch.tensor(1.0 / 3.0, dtype=torch.float64)) == 1.0 / 3.0  # float64: exact
    assert as_written(1.33) == 1.33
