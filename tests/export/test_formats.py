"""format_of and export_model: the format of a model file, chosen by its extension or
named."""

import pytest
import torch

import petfunc
from petfunc.export import FORMATS, check_model_file, export_model, format_of


def test_format_by_extension_or_name():
    assert FORMATS == {"metatomic": ".pt", "pt2": ".pt2", "metatrain-checkpoint": ".ckpt"}
    assert format_of("model.pt") == "metatomic"
    assert format_of("out/model.pt2") == "pt2"
    assert format_of("model.ckpt") == "metatrain-checkpoint"
    assert format_of("model.torchscript", "metatomic") == "metatomic"
    assert format_of("model.pt", "metatomic") == "metatomic"
    with pytest.raises(ValueError, match=r"cannot tell the format of 'model.bin'.*\.pt \(metatomic\)"):
        format_of("model.bin")
    with pytest.raises(ValueError, match=r"'m.pt2' has the extension of the pt2 format, not of metatomic"):
        format_of("m.pt2", "metatomic")
    with pytest.raises(ValueError, match="unknown export format 'onnx'"):
        format_of("m.onnx", "onnx")


def test_pt2_options_are_refused_for_other_formats(tmp_path):
    config = petfunc.PETConfig(atomic_types=(1, 6), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)
    params = petfunc.init(config, seed=0, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"aoti: options of the pt2 format, not of metatomic"):
        export_model(config, params, tmp_path / "model.pt", aoti=False)
    assert not (tmp_path / "model.pt").exists()


def test_export_model_writes_each_format(tmp_path):
    pytest.importorskip("metatrain")
    from metatomic.torch import load_atomistic_model

    config = petfunc.PETConfig(atomic_types=(1, 6), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)
    params = petfunc.init(config, seed=0, dtype=torch.float64)
    model = load_atomistic_model(str(export_model(config, params, tmp_path / "model.pt")))
    assert model.capabilities().dtype == "float64"
    checkpoint = export_model(config, params, tmp_path / "model.ckpt")
    loaded_config, loaded = petfunc.load_model(checkpoint)
    assert loaded_config == config
    flat = petfunc.tree.flatten(params)
    assert all(torch.equal(value, flat[name]) for name, value in petfunc.tree.flatten(loaded).items())


def test_model_files_by_suffix(tmp_path):
    """The model file of ``petfunc train -o FILE``, checked before the run."""
    assert check_model_file(tmp_path / "a.pt2") == tmp_path / "a.pt2"
    assert check_model_file(tmp_path / "a.pt") == tmp_path / "a.pt"
    with pytest.raises(ValueError, match=r"must end in .pt2 \(petfunc's PT2 archive\) or .pt"):
        check_model_file(tmp_path / "a.onnx")
    (tmp_path / "b.pt2").mkdir()
    with pytest.raises(ValueError, match="is an existing folder"):
        check_model_file(tmp_path / "b.pt2")
