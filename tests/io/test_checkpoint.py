"""The training checkpoint (petfunc.io.checkpoint): what write_checkpoint writes
read_checkpoint reads back, with every key; a file of another kind or version is
refused with its name."""

import math

import pytest
import torch

import petfunc
from petfunc.io import read_checkpoint, write_checkpoint
from petfunc.io.checkpoint import CHECKPOINT_VERSION, is_checkpoint, model_of
from petfunc.io.digest import DIGEST_KEY, payload_digest
from tests.helpers.damage import without_digest


CONFIG = petfunc.PETConfig(atomic_types=(1, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)


def _write(path, best_metric=0.25, best_params="best"):
    params = petfunc.PET(CONFIG).init(seed=0)
    best = petfunc.PET(CONFIG).init(seed=1) if best_params == "best" else None
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 10))
    state = petfunc.init_state(params, optimizer)
    write_checkpoint(
        path,
        config=CONFIG,
        params=state.params,
        opt_state=state.opt_state,
        epoch=3,
        step=12,
        best_epoch=2,
        best_metric=best_metric,
        best_params=best,
        composition=[-1.5, -3.0],
        energy_scale=0.5,
        dtype=torch.float32,
        seed=7,
        options={"seed": 7, "architecture": {"name": "pet"}},
        history=[{"epoch": 1, "loss": 2.0}],
        split={"training": [[0, 1]]},
        world_size=2,
        version=petfunc.__version__,
    )
    return params, best


def test_write_then_read(tmp_path):
    params, best = _write(tmp_path / "last.ckpt")
    ckpt = read_checkpoint(tmp_path / "last.ckpt")
    assert is_checkpoint(ckpt) and ckpt["format_version"] == CHECKPOINT_VERSION
    assert (ckpt["epoch"], ckpt["step"], ckpt["best_epoch"], ckpt["best_metric"]) == (3, 12, 2, 0.25)
    assert ckpt["dtype"] == "float32" and ckpt["rng"]["seed"] == 7 and ckpt["world_size"] == 2
    assert ckpt["energy_scale"] == 0.5 and ckpt["composition"]["atomic_types"] == [1, 8]
    assert ckpt["composition"]["weights"].dtype == torch.float64
    assert ckpt["history"] == [{"epoch": 1, "loss": 2.0}] and ckpt["split"] == {"training": [[0, 1]]}
    # the best parameters by default, the last ones on request, exactly as written
    config, loaded = model_of(ckpt, "best")
    assert config == CONFIG
    for key, value in petfunc.tree.flatten(best).items():
        assert torch.equal(petfunc.tree.flatten(loaded)[key], value), key
    _, last = model_of(ckpt, "last")
    for key, value in petfunc.tree.flatten(params).items():
        assert torch.equal(petfunc.tree.flatten(last)[key], value), key


def test_no_best_epoch_yet(tmp_path):
    params, _ = _write(tmp_path / "last.ckpt", best_metric=math.inf, best_params=None)
    ckpt = read_checkpoint(tmp_path / "last.ckpt")
    assert ckpt["best_metric"] is None and ckpt["best_params"] is None
    _, loaded = model_of(ckpt, "best")  # the last parameters stand in
    assert torch.equal(loaded["edge_embedder"]["weight"], params["edge_embedder"]["weight"])


def test_other_files_are_refused_by_name(tmp_path):
    with pytest.raises(FileNotFoundError, match="no.ckpt"):
        read_checkpoint(tmp_path / "no.ckpt")
    petfunc.save_params(tmp_path / "params.pt", CONFIG, petfunc.PET(CONFIG).init(seed=0))
    with pytest.raises(ValueError, match="params.pt' is not a petfunc training checkpoint"):
        read_checkpoint(tmp_path / "params.pt")
    (tmp_path / "junk.ckpt").write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="junk.ckpt' is not a readable petfunc checkpoint"):
        read_checkpoint(tmp_path / "junk.ckpt")
    _write(tmp_path / "new.ckpt")
    payload = torch.load(tmp_path / "new.ckpt", weights_only=True)
    payload["format_version"] = CHECKPOINT_VERSION + 1
    torch.save(payload, tmp_path / "newer.ckpt")
    with pytest.raises(ValueError, match=f"version {CHECKPOINT_VERSION + 1}"):
        read_checkpoint(tmp_path / "newer.ckpt")


def test_checkpoints_carry_a_digest_and_those_without_one_still_load(tmp_path):
    _write(tmp_path / "last.ckpt")
    stored = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert stored[DIGEST_KEY] == payload_digest(stored) and stored[DIGEST_KEY].startswith("sha256:")
    new = read_checkpoint(tmp_path / "last.ckpt")
    without_digest(tmp_path / "last.ckpt")  # as petfunc wrote it before it stored a digest
    old = read_checkpoint(tmp_path / "last.ckpt")
    assert DIGEST_KEY not in old and old["format_version"] == CHECKPOINT_VERSION
    assert old["epoch"] == new["epoch"] and old["params"].keys() == new["params"].keys()
    assert all(torch.equal(old["params"][k], new["params"][k]) for k in old["params"])
