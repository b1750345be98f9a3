"""Checkpoints and the output folder: plain data that loads with weights_only, the
optimizer state round trip, a restart's settling of best.ckpt and epoch_N.ckpt,
the temporary files a killed run leaves.
"""

import json

import pytest
import torch

from petfunc.io import load_model, read_checkpoint
from petfunc.io.checkpoint import state_from_plain, state_to_plain
from petfunc.io.digest import with_digest
from petfunc.train import make_optimizer, trainable, warmup_cosine
from petfunc.trainer import fit
from tests.helpers.trainer import assert_plain, params_equal, quiet, tiny_options


def test_checkpoint_contents(dataset, tmp_path):
    result = fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    # Plain data only: loads with weights_only=True.
    ckpt = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert ckpt["format"] == "petfunc.checkpoint" and ckpt["epoch"] == 1 and ckpt["step"] == 3
    assert_plain(ckpt["opt_state"])
    assert json.loads(ckpt["options"])["architecture"]["model"]["d_pet"] == 8
    assert ckpt["composition"]["atomic_types"] == [13, 28, 29]
    assert ckpt["composition"]["weights"].dtype == torch.float64
    # The fitted composition and scale are in the params, not trained.
    assert torch.equal(ckpt["params"]["composition_weights"], ckpt["composition"]["weights"])
    assert ckpt["params"]["energy_scale"].item() == ckpt["energy_scale"]
    assert ckpt["params"]["gnn_layers.0.edge_embedder.weight"].dtype == torch.float32
    # load_model gives (config, params) for the checkpoint and the params file alike.
    config, params = load_model(tmp_path / "best.ckpt")
    config2, params2 = load_model(tmp_path / "best_params.pt")
    assert config == config2 == result.config
    assert params_equal(params, params2) and params_equal(params, result.params)


def test_optimizer_state_roundtrip(tmp_path):
    params = {"a": torch.randn(3), "b": [torch.randn(2, 2)], "composition_weights": torch.zeros(2)}
    optimizer = make_optimizer(warmup_cosine(1e-3, 10), weight_decay=0.01)
    state = optimizer.init(trainable(params))
    # A state with non-zero entries: one update.
    grads = torch.utils._pytree.tree_map(torch.ones_like, trainable(params))
    _, state = optimizer.update(grads, state, params=trainable(params))
    plain = state_to_plain(state)
    assert_plain(plain)
    torch.save(plain, tmp_path / "s.pt")
    loaded = torch.load(tmp_path / "s.pt", weights_only=True)
    restored = state_from_plain(loaded, optimizer.init(trainable(params)))
    flat_a, spec_a = torch.utils._pytree.tree_flatten(state)
    flat_b, spec_b = torch.utils._pytree.tree_flatten(restored)
    assert spec_a == spec_b and all(torch.equal(a, b) for a, b in zip(flat_a, flat_b))
    # A state that does not fit the optimizer is refused.
    with pytest.raises(ValueError, match="opt_state"):
        state_from_plain({"__namedtuple__": "Other"}, state)
    other = make_optimizer(warmup_cosine(1e-3, 10)).init({"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="opt_state"):
        state_from_plain(plain, other)


def test_restart_makes_the_folder_agree_with_the_checkpoint(dataset, tmp_path):
    """A restart leaves best.ckpt holding the checkpoint's best epoch: after a kill
    between last.ckpt and best.ckpt (best.ckpt stayed an older epoch), after a
    restart from an earlier checkpoint into a folder that went further, and in a new
    folder; without a source it removes a stale best.ckpt and says so. A run killed
    after its last epoch's checkpoint is finished by a restart at that epoch."""
    options = tiny_options(dataset, num_epochs=3, checkpoint_interval=1, learning_rate=3e-3)
    result = fit(options, tmp_path / "run", progress=False, log=quiet())
    run = tmp_path / "run"
    best_bytes = (run / "best.ckpt").read_bytes()
    best_epoch = result.best_epoch
    older = 1 if best_epoch != 1 else 2
    assert read_checkpoint(run / "best.ckpt")["epoch"] == best_epoch

    # the kill: best.ckpt of an older epoch, no best_params.pt, plots or last CSV row
    (run / "best.ckpt").write_bytes((run / f"epoch_{older}.ckpt").read_bytes())
    (run / "best_params.pt").unlink()
    (run / "parity.png").unlink()
    rows = (run / "metrics.csv").read_text().splitlines()
    (run / "metrics.csv").write_text("\n".join(rows[:-1]) + "\n")
    lines = []
    finished = fit(None, restart=run / "last.ckpt", progress=False, log=quiet(lines))
    assert any("nothing to train, writing the end-of-run files" in line for line in lines)
    assert (run / "best.ckpt").read_bytes() == best_bytes
    assert (run / "best_params.pt").exists() and (run / "parity.png").exists()
    assert len((run / "metrics.csv").read_text().splitlines()) == len(rows)
    assert finished.best_epoch == best_epoch and params_equal(finished.params, result.params)

    # a restart from epoch 1 into the same folder, with another learning rate: nothing
    # of the folder is replaced before its first last.ckpt (here it stops before)
    changed = json.loads(read_checkpoint(run / "epoch_1.ckpt")["options"])
    changed["architecture"]["training"].update(num_epochs=2, learning_rate=0.3)
    before = {p.name: p.read_bytes() for p in run.glob("*.ckpt")}

    def stop_at_training(message):
        if message.startswith("training set:"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(changed, run, restart=run / "epoch_1.ckpt", progress=False, log=stop_at_training)
    assert {p.name: p.read_bytes() for p in run.glob("*.ckpt")} == before
    lines = []
    fit(changed, run, restart=run / "epoch_1.ckpt", progress=False, log=quiet(lines))
    assert any(
        "epoch_2.ckpt, epoch_3.ckpt of later epochs of the run this restart continues, or of another run"
        in line
        for line in lines
    )
    final = next(line for line in lines if line.startswith("files of this run"))
    assert "epoch_2.ckpt" in final and "epoch_3.ckpt" not in final
    best = read_checkpoint(run / "best.ckpt")
    assert best["epoch"] == read_checkpoint(run / "last.ckpt")["best_epoch"]

    # a restart at the last epoch into a new folder: a last.ckpt there too
    fit(None, tmp_path / "ended", restart=run / "epoch_2.ckpt", progress=False, log=quiet())
    assert read_checkpoint(tmp_path / "ended" / "last.ckpt")["epoch"] == 2

    # a fresh run into a used folder says what it replaces
    lines = []
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet(lines))
    assert any(
        "holds the last.ckpt and best.ckpt of another run: this run replaces them" in line for line in lines
    )
    assert any("epoch_2.ckpt, epoch_3.ckpt of another run: they stay" in line for line in lines)

    # a new folder: the best epoch's checkpoint is copied from the old one
    fit(options, tmp_path / "again", progress=False, log=quiet())
    lines = []
    fit(None, tmp_path / "new", restart=tmp_path / "again" / "last.ckpt", progress=False, log=quiet(lines))
    best_bytes = (tmp_path / "again" / "best.ckpt").read_bytes()
    assert (tmp_path / "new" / "best.ckpt").read_bytes() == best_bytes
    assert any(line.startswith(f"best.ckpt: epoch {best_epoch}") for line in lines)
    # no source of the best epoch: a stale best.ckpt is removed, and that is said
    (tmp_path / "lone").mkdir()
    ckpt = read_checkpoint(tmp_path / "again" / "last.ckpt")
    ckpt["best_epoch"] = 2
    ckpt["best_params"] = {k: v + 1.0 for k, v in ckpt["params"].items()}  # held by no file
    torch.save(with_digest(ckpt), tmp_path / "lone" / "last.ckpt")
    (tmp_path / "lone" / "best.ckpt").write_bytes(best_bytes)
    lines = []
    fit(None, restart=tmp_path / "lone" / "last.ckpt", progress=False, log=quiet(lines))
    assert not (tmp_path / "lone" / "best.ckpt").exists()
    assert any(line.startswith("removed best.ckpt (another epoch's); the best epoch (2)") for line in lines)


def test_restart_removes_what_a_killed_run_left(dataset, tmp_path):
    fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    # what atomic_write leaves when SIGKILL comes between creating and renaming
    leftovers = [
        tmp_path / ".last.ckpt.k3j_x1.tmp",
        tmp_path / ".epoch_2.ckpt.a8.tmp",
        tmp_path / ".metrics.csv.zz.tmp",
    ]
    kept = tmp_path / ".notes.txt.tmp"  # not a name the trainer writes
    for path in leftovers + [kept]:
        path.write_bytes(b"partial")
    lines = []
    fit(
        tiny_options(dataset, num_epochs=2),
        tmp_path,
        restart=tmp_path / "last.ckpt",
        progress=False,
        log=lines.append,
    )
    assert not any(path.exists() for path in leftovers)
    assert kept.exists()
    assert any("removed 3 temporary file(s)" in line for line in lines)
