"""Reading any model file (petfunc.io.load.load_model and the other readers):
damaged files are named as unreadable by every reader, and the best or last
weights of a metatrain checkpoint are picked."""

import zipfile

import pytest
import torch

import petfunc
from tests.helpers.io_setup import metatrain_reference, small_config, small_params


def test_load_corrupt_and_truncated_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params(tmp_path / "junk")
    config = small_config()
    petfunc.save_params(tmp_path / "good", config, small_params(config))
    data = (tmp_path / "good").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params(tmp_path / "cut")
    # a damaged central directory behind an intact end record: zipfile.is_zipfile says
    # yes, and zipfile raises BadZipFile on opening it; every loader names the file
    # as unreadable (a ValueError)
    broken = bytearray(data)
    start = zipfile.ZipFile(tmp_path / "good").start_dir
    broken[start + 3] ^= 0xFF
    (tmp_path / "directory").write_bytes(bytes(broken))
    assert zipfile.is_zipfile(tmp_path / "directory")
    from petfunc.io import load_model

    for load in (
        petfunc.load_params,
        petfunc.from_metatrain,
        load_model,
        petfunc.ase.PETCalculator.from_exported,
    ):
        with pytest.raises(ValueError, match="not a readable"):
            load(tmp_path / "directory")


def test_which_picks_best_or_last_weights_of_a_metatrain_checkpoint(tmp_path):
    """metatrain checkpoints hold the best and the last weights; ``which`` (``petfunc
    eval/export --which``) picks one, as it does for petfunc's own checkpoints."""
    ref = metatrain_reference()
    from petfunc.io import load_model

    config = small_config()
    model = ref.make_model(config)
    ref.load_params(model, small_params(config))
    checkpoint = model.get_checkpoint()
    key = "backend.gnn_layers.0.edge_embedder.weight"
    last = dict(checkpoint["model_state_dict"])
    last[key] = last[key] + 1.0
    checkpoint["model_state_dict"] = last
    torch.save(checkpoint, tmp_path / "model.ckpt")
    _, best = load_model(tmp_path / "model.ckpt", which="best")
    _, latest = load_model(tmp_path / "model.ckpt", which="last")
    name = "gnn_layers.0.edge_embedder.weight"
    torch.testing.assert_close(
        petfunc.tree.flatten(latest)[name] - petfunc.tree.flatten(best)[name],
        torch.ones_like(petfunc.tree.flatten(best)[name]),
    )
    model.export().save(str(tmp_path / "model.pt"))
    load_model(tmp_path / "model.pt")
    with pytest.raises(ValueError, match="exported model, with one set of weights"):
        load_model(tmp_path / "model.pt", which="last")
