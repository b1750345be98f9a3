"""``petfunc export MODEL [OUTPUT | -o OUTPUT] [--format ...]``: the format by the
output's extension, metatrain's ``-o`` and default output name, and the refusals."""

import pytest
import torch

import petfunc
from petfunc.cli.commands import main


CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)


@pytest.fixture
def params_file(tmp_path):
    path = tmp_path / "params.pt"
    petfunc.save_params(path, CONFIG, petfunc.init(CONFIG, seed=0, dtype=torch.float64))
    return path


def test_metatomic_and_metatrain_outputs(params_file, tmp_path, monkeypatch, capsys):
    pytest.importorskip("metatrain")
    from metatomic.torch import load_atomistic_model

    assert main(["export", str(params_file), "-o", str(tmp_path / "model.pt")]) == 0
    assert "as a metatomic model" in capsys.readouterr().out
    assert load_atomistic_model(str(tmp_path / "model.pt")).capabilities().dtype == "float64"
    assert main(["export", str(params_file), str(tmp_path / "model.ckpt")]) == 0
    assert petfunc.load_model(tmp_path / "model.ckpt")[0] == CONFIG
    # a metatrain checkpoint exports too, in another dtype on request
    out = tmp_path / "from_ckpt.pt"
    assert main(["export", str(tmp_path / "model.ckpt"), "-o", str(out), "--dtype", "float32"]) == 0
    assert load_atomistic_model(str(out)).capabilities().dtype == "float32"
    # without an output: the model's name with .pt in the working folder, as mtt export
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert main(["export", str(tmp_path / "model.ckpt")]) == 0
    assert (tmp_path / "elsewhere" / "model.pt").is_file()


def test_refusals(params_file, tmp_path, monkeypatch, capsys):
    def error_of(*args):
        assert main(["export", str(params_file), *args]) == 2
        return capsys.readouterr().err

    assert "two output files" in error_of(str(tmp_path / "a.pt"), "-o", str(tmp_path / "b.pt"))
    assert "cannot tell the format of" in error_of("-o", str(tmp_path / "m.bin"))
    assert "has the extension of the pt2 format" in error_of(
        "-o", str(tmp_path / "m.pt2"), "--format", "metatomic"
    )
    for flags in (["--device", "cpu"], ["--no-aoti"], ["--long-range", "ewald"]):
        assert "options of the .pt2 format, not of metatomic" in error_of(
            "-o", str(tmp_path / "m.pt"), *flags
        )
    monkeypatch.chdir(tmp_path)
    assert "is the model file itself" in error_of()  # params.pt -> params.pt
    assert not any(p.suffix in (".pt2", ".ckpt") for p in tmp_path.iterdir())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.pt"]
