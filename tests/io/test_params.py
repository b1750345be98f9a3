"""The parameter file (petfunc.io.params: save_params, load_params): exact round
trips, atomic writes with ordinary permissions, and the files it refuses."""

import os
import pickle

import pytest
import torch

import petfunc
from petfunc.io.digest import DIGEST_KEY, payload_digest, with_digest
from tests.helpers.damage import without_digest
from tests.helpers.io_setup import assert_same_params, small_config, small_params


def test_roundtrip_is_exact(tmp_path):
    config = small_config(num_neighbors_adaptive=7, adaptive_cutoff_method="grid", cutoff_function="Cosine")
    params = small_params(config, dtype=torch.float32)  # float32 network, float64 composition
    path = tmp_path / "model.pft"
    petfunc.save_params(path, config, params)
    loaded_config, loaded = petfunc.load_params(path)
    assert loaded_config == config
    assert_same_params(loaded, params)
    assert isinstance(loaded["gnn_layers"], list)
    # only the file: the temporary file was renamed into place
    assert os.listdir(tmp_path) == ["model.pft"]


def test_load_casts_dtype(tmp_path):
    config = small_config()
    petfunc.save_params(tmp_path / "p", config, small_params(config))
    _, params = petfunc.load_params(tmp_path / "p", dtype=torch.float32)
    assert {t.dtype for t in petfunc.tree.flatten(params).values()} == {torch.float32}


def test_file_is_plain_data(tmp_path):
    config = small_config()
    petfunc.save_params(tmp_path / "p", config, small_params(config))
    payload = torch.load(tmp_path / "p", weights_only=True)
    assert payload["format"] == "petfunc.params"
    assert set(payload["params"]) == set(petfunc.tree.flatten(small_params(config)))


def test_overwrite_and_failed_save_keep_old_file(tmp_path, monkeypatch):
    config = small_config()
    path = tmp_path / "p"
    petfunc.save_params(path, config, small_params(config, seed=1))
    petfunc.save_params(path, config, small_params(config, seed=2))
    assert_same_params(petfunc.load_params(path)[1], small_params(config, seed=2))

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        petfunc.save_params(path, config, small_params(config, seed=3))
    monkeypatch.undo()
    assert_same_params(petfunc.load_params(path)[1], small_params(config, seed=2))
    assert os.listdir(tmp_path) == ["p"]


def test_save_rejects_params_of_another_config(tmp_path):
    params = small_params(small_config())
    with pytest.raises(ValueError, match=r"gnn_layers\.0\.edge_embedder\.weight has shape"):
        petfunc.save_params(tmp_path / "p", small_config(d_pet=12, num_heads=2), params)
    del params["energy_scale"]
    with pytest.raises(ValueError, match="missing.*energy_scale"):
        petfunc.save_params(tmp_path / "p", small_config(), params)
    assert not os.listdir(tmp_path)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no petfunc parameter file"):
        petfunc.load_params(tmp_path / "nope")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned_by_pickle",))


def test_load_never_runs_pickled_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("evil", "wb") as handle:
        pickle.dump({"format": "petfunc.params", "x": _Evil()}, handle)
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params("evil")
    torch.save({"format": "petfunc.params", "x": _Evil()}, "evil2")
    with pytest.raises(ValueError, match="from_metatrain"):
        petfunc.load_params("evil2")
    assert not os.path.exists("pwned_by_pickle")


def test_load_wrong_content(tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a petfunc parameter file"):
        petfunc.load_params(tmp_path / "other")

    config = small_config()
    petfunc.save_params(tmp_path / "p", config, small_params(config))
    payload = torch.load(tmp_path / "p", weights_only=True)

    bad = dict(payload, format_version=99)
    torch.save(with_digest(bad), tmp_path / "version")
    with pytest.raises(ValueError, match="format version 99"):
        petfunc.load_params(tmp_path / "version")

    bad = dict(payload, params={k: v for k, v in payload["params"].items() if "compress" not in k})
    torch.save(with_digest(bad), tmp_path / "missing")
    with pytest.raises(ValueError, match=r"missing \[.*compress"):
        petfunc.load_params(tmp_path / "missing")

    bad = dict(payload, config=payload["config"].replace('"d_pet": 8', '"d_pet": 0'))
    torch.save(with_digest(bad), tmp_path / "config")
    with pytest.raises(ValueError, match="invalid config: d_pet must be a positive integer, got 0"):
        petfunc.load_params(tmp_path / "config")

    bad = dict(payload, config="{not json")
    torch.save(with_digest(bad), tmp_path / "json")
    with pytest.raises(ValueError, match="unreadable config"):
        petfunc.load_params(tmp_path / "json")


def test_written_files_get_ordinary_permissions(tmp_path):
    """Files are written through a temporary file (mkstemp: mode 0600) and renamed; they
    must end up with the mode a plain open() gives (0666 less the umask), or keep the
    mode of the file they replace."""
    import stat

    from petfunc.io import atomic_write

    mask = os.umask(0o027)
    try:
        path = tmp_path / "params.pt"
        petfunc.save_params(path, small_config(), small_params(small_config()))
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(mask)
    path.chmod(0o604)
    atomic_write(path, lambda handle: handle.write(b"x"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o604 and path.read_bytes() == b"x"
    assert [p.name for p in tmp_path.iterdir()] == ["params.pt"]  # no temporary left


def test_params_files_carry_a_digest_and_those_without_one_still_load(tmp_path):
    config = small_config()
    params = small_params(config)
    petfunc.save_params(tmp_path / "p.pt", config, params)
    stored = torch.load(tmp_path / "p.pt", weights_only=True)
    assert stored[DIGEST_KEY] == payload_digest(stored) and stored[DIGEST_KEY].startswith("sha256:")
    without_digest(tmp_path / "p.pt")  # as petfunc wrote it before it stored a digest
    assert DIGEST_KEY not in torch.load(tmp_path / "p.pt", weights_only=True)
    loaded_config, loaded = petfunc.load_params(tmp_path / "p.pt")
    assert loaded_config == config
    assert_same_params(loaded, params)
    assert_same_params(petfunc.load_model(tmp_path / "p.pt")[1], params)
