"""fit end to end: the loss falls, runs repeat, the best epoch, the NaN stop,
compiled and rematerialised steps, long-range and charge-conditioned models.

All runs use a tiny PET (tests/helpers/trainer.py) on a few EMT structures, so
each fit takes seconds.
"""

import copy
import hashlib
import importlib
import math

import pytest
import torch

from petfunc import tree
from petfunc.cli import main
from petfunc.io import load_model
from petfunc.model import PET
from petfunc.trainer import TrainingError, fit
from tests.helpers.trainer import params_equal, quiet, tiny_options


def test_loss_falls(dataset, tmp_path):
    # Energies and forces only, d_pet=16, 10 epochs of 6 steps.
    options = tiny_options(dataset, num_epochs=10, learning_rate=3e-2, batch_size=2)
    options["architecture"]["model"].update(d_pet=16, d_head=16, d_node=16, d_feedforward=16)
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"stress": False}}}
    result = fit(options, tmp_path, progress=False, log=quiet())
    losses = [row["train_loss"] for row in result.history]
    val = [row["val_loss"] for row in result.history]
    assert min(losses[-3:]) < 0.5 * losses[0], f"training losses per epoch: {losses}"
    assert min(val[-3:]) < 0.7 * val[0], f"validation losses per epoch: {val}"
    # Stress is off: no stress column; validation metrics are there.
    assert "train_stress_rmse" not in result.history[0]
    assert all(math.isfinite(row["val_forces_rmse"]) for row in result.history)
    assert 1 <= result.best_epoch <= 10
    # Files.
    for name in ("last.ckpt", "best.ckpt", "metrics.csv", "parity.png", "best_params.pt"):
        assert (tmp_path / name).is_file(), name
    csv_lines = (tmp_path / "metrics.csv").read_text().splitlines()
    assert len(csv_lines) == 11 and csv_lines[0].startswith("epoch,step,learning_rate,train_loss")


def test_log_interval_only_spaces_the_printed_lines(dataset):
    """metatrain validates and picks the best model every epoch; log_interval only
    says how often a line is printed. The best epoch must not depend on it."""
    runs = {}
    for interval in (1, 3):
        lines = []
        result = fit(
            tiny_options(dataset, num_epochs=4, log_interval=interval), None, progress=False, log=quiet(lines)
        )
        printed = [int(line.split()[1].split("/")[0]) for line in lines if line.startswith("epoch ")]
        runs[interval] = result, printed
    (one, printed_one), (three, printed_three) = runs[1], runs[3]
    assert printed_one == [1, 2, 3, 4] and printed_three == [1, 3, 4]
    assert all(math.isfinite(row["val_loss"]) for row in three.history) and len(three.history) == 4
    assert [row["selection_metric"] for row in three.history] == [
        row["selection_metric"] for row in one.history
    ]
    metrics = [row["selection_metric"] for row in three.history]
    assert three.best_epoch == one.best_epoch == 1 + metrics.index(min(metrics))
    assert params_equal(three.params, one.params)


def test_nan_stops_without_corrupting_checkpoints(dataset, tmp_path):
    good = fit(tiny_options(dataset, num_epochs=1), tmp_path, progress=False, log=quiet())
    digests = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.glob("*.ckpt")}
    # Continue with an absurd learning rate: the loss becomes inf/NaN.
    options = tiny_options(dataset, num_epochs=3, learning_rate=1e30, warmup_fraction=0.0)
    with pytest.raises(TrainingError, match=r"training loss is (nan|inf) at epoch 2"):
        fit(options, tmp_path, restart=tmp_path / "last.ckpt", progress=False, log=quiet())
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.glob("*.ckpt")}
    assert after == digests, "a checkpoint was overwritten by the diverged run"
    assert not list(tmp_path.glob(".*.tmp")), "temporary files left behind"
    config, params = load_model(tmp_path / "last.ckpt", which="last")
    assert all(torch.isfinite(t).all() for t in tree.flatten(params).values())
    assert params_equal(params, good.last_params)


def test_remat_training_equals_plain(dataset, monkeypatch):
    # recomputed transformer layers (petfunc.remat): the same training, float64,
    # through the train step and the validation loss
    remat_module = importlib.import_module("petfunc.remat")  # petfunc.remat is the function

    options = tiny_options(dataset, num_epochs=2)
    options["base_precision"] = 64
    options["architecture"]["model"]["num_attention_layers"] = 2
    plain = fit(options, None, progress=False, log=quiet())
    checkpointed = []
    original = remat_module.checkpoint
    monkeypatch.setattr(
        remat_module, "checkpoint", lambda *a, **k: checkpointed.append(1) or original(*a, **k)
    )
    options["architecture"]["training"]["remat"] = True
    recomputed = fit(options, None, progress=False, log=quiet())
    assert checkpointed  # the layers did go through torch.utils.checkpoint
    fa, fb = tree.flatten(plain.last_params), tree.flatten(recomputed.last_params)
    for key in fa:
        torch.testing.assert_close(fa[key], fb[key], rtol=1e-12, atol=1e-14, msg=key)
    assert plain.history[-1]["val_loss"] == pytest.approx(recomputed.history[-1]["val_loss"], rel=1e-12)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_float32_runs_repeat_exactly(dataset, compiled):
    """Two float32 runs with the same options give bitwise the same model. With two
    threads, torch's float32 ``index_put_(accumulate=True)`` (the adjoint of every
    gather in the eager step; the traced step's scatter-adds with aot_eager) adds with
    atomics in thread order; ``deterministic`` (the default on CPU) fixes the order.
    The setting is restored after ``fit``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        extra = {"compile": True, "compile_backend": "aot_eager"} if compiled else {}
        options = tiny_options(dataset, num_epochs=2, batch_size=8, **extra)
        options["architecture"]["model"].update(cutoff=5.0)
        runs = [fit(options, None, progress=False, log=quiet()) for _ in range(2)]
    finally:
        torch.set_num_threads(threads)
    assert not torch.are_deterministic_algorithms_enabled()
    assert params_equal(runs[0].last_params, runs[1].last_params)
    assert [r["train_loss"] for r in runs[0].history] == [r["train_loss"] for r in runs[1].history]


@pytest.mark.slow
def test_compiled_fit_matches_eager(dataset):
    # compile: true with the quick aot_eager backend, float64: the same training as
    # eager, and no recompilation across the differently sized batches.
    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    eager = fit(options, None, progress=False, log=quiet())
    options["architecture"]["training"].update(compile=True, compile_backend="aot_eager")
    compiled = fit(options, None, progress=False, log=quiet())
    from torch._dynamo.utils import guard_failures

    reasons = {getattr(code, "co_name", str(code)): r for code, r in guard_failures.items()}
    assert compiled.compiled_graphs == {"train": 1, "eval": 1}, f"recompilations: {reasons}"
    a, b = tree.flatten(eager.last_params), tree.flatten(compiled.last_params)
    for key in a:
        torch.testing.assert_close(b[key], a[key], rtol=1e-9, atol=1e-12, msg=key)
    for row_e, row_c in zip(eager.history, compiled.history):
        assert math.isclose(row_e["val_loss"], row_c["val_loss"], rel_tol=1e-9)


@pytest.mark.slow
def test_compiled_fit_reuses_its_trace(dataset, tmp_path, monkeypatch):
    # a second identical run loads the trace (petfunc.compile's cache) and trains
    # bit for bit the same; another learning rate traces afresh
    monkeypatch.setenv("PETFUNC_TRACE_CACHE_DIR", str(tmp_path))
    options = tiny_options(dataset, num_epochs=1, compile=True, compile_backend="aot_eager")
    runs = []
    for learning_rate in (1e-2, 1e-2, 2e-2):
        options["architecture"]["training"]["learning_rate"] = learning_rate
        lines = []
        runs.append((fit(copy.deepcopy(options), None, progress=False, log=quiet(lines)), lines))
    cached = [any("loaded the cached trace" in line for line in lines) for _, lines in runs]
    assert cached == [False, True, False]
    assert params_equal(runs[0][0].last_params, runs[1][0].last_params)
    assert not params_equal(runs[0][0].last_params, runs[2][0].last_params)


def test_long_range_training(dataset, tmp_path):
    """A model with long-range features trains (Ewald batches), its weights move, and
    the checkpoint evaluates (P3M) with the errors the trainer reported."""
    options = tiny_options(dataset)
    options["architecture"]["model"]["long_range"] = {"enable": True, "kspace_resolution": 1.0}
    lines = []
    fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    config, params = load_model(tmp_path / "run" / "best.ckpt")
    assert config.long_range.enable and config.long_range.kspace_resolution == 1.0
    fresh = PET(config).init(seed=options["seed"], dtype=torch.float32)
    key = "long_range_featurizer.charges_map.weight"
    assert not torch.allclose(tree.flatten(params)[key], tree.flatten(fresh)[key])
    assert main(["eval", str(tmp_path / "run" / "best.ckpt"), str(dataset)]) == 0


def test_charge_and_spin_conditioned_training(dataset, tmp_path):
    """metatrain's ``extra_data`` section names the info keys of the charge and spin
    multiplicity; the conditioning gate (zero at init) learns from them."""
    import ase.io

    frames = ase.io.read(dataset, ":")
    for i, atoms in enumerate(frames):
        atoms.info["q"] = i % 3 - 1
        atoms.info["mult"] = 1 + i % 2
    path = tmp_path / "charged.xyz"
    ase.io.write(path, frames)
    options = tiny_options(path)
    options["architecture"]["model"].update(system_conditioning=True, max_charge=2, max_spin_multiplicity=3)
    options["training_set"] = {
        "systems": str(path),
        "extra_data": {"charge": {"key": "q"}, "spin_multiplicity": {"key": "mult"}},
    }
    fit(options, tmp_path / "run", progress=False, log=quiet())
    config, params = load_model(tmp_path / "run" / "best.ckpt")
    assert config.system_conditioning and config.max_charge == 2
    gate = tree.flatten(params)["system_conditioning.project.2.weight"]
    assert gate.abs().max() > 0
    from petfunc.data import read_labelled

    samples = read_labelled(path, config, charge_key="q", spin_multiplicity_key="mult")
    assert [s.structure.charge for s in samples[:4]] == [-1, 0, 1, -1]
    assert [s.structure.spin_multiplicity for s in samples[:3]] == [1, 2, 1]
    with pytest.raises(ValueError, match="charge_key: no structure .* has the info key 'Q'"):
        read_labelled(path, config, charge_key="Q")

    options["training_set"]["extra_data"]["charge"]["key"] = "total_charge"
    with pytest.raises(
        ValueError, match=r"training_set.extra_data.charge: no structure .* has the info key 'total_charge'"
    ):
        fit(options, None, progress=False, log=quiet())
    frames[3].info["q"] = 5
    ase.io.write(path, frames)
    options["training_set"]["extra_data"]["charge"]["key"] = "q"
    with pytest.raises(ValueError, match=r"structure 3: charge 5 is outside the model's range \[-2, 2\]"):
        fit(options, None, progress=False, log=quiet())


@pytest.mark.parametrize("compile_on", [False, True], ids=["eager", "aot_eager"])
def test_best_model_metric_counts_terms_of_weight_zero(dataset, compile_on):
    """metatrain's mae_prod multiplies the errors of every labelled quantity, whatever
    its loss weight: a forces term of weight 0 was left out of petfunc's product (and
    of its validation columns), so another best epoch could be picked."""
    options = tiny_options(
        dataset,
        num_epochs=1,
        loss={"energy": {"forces": {"weight": 0}}},
        compile=compile_on,
        compile_backend="aot_eager",
    )
    result = fit(options, None, progress=False, log=quiet())
    row = result.history[-1]
    assert "train_forces_mae" not in row  # no forces are computed in the training step
    product = row["val_energy_mae"] * row["val_forces_mae"] * row["val_stress_mae"]
    assert row["selection_metric"] == pytest.approx(product, rel=1e-12)
    # the loss itself has no forces term: that of the same run with the term dropped
    without = {**options, "training_set": {"systems": str(dataset), "targets": {"energy": {"forces": False}}}}
    dropped = fit(without, None, progress=False, log=quiet())
    assert "val_forces_mae" not in dropped.history[-1]
    assert dropped.history[-1]["val_loss"] == pytest.approx(row["val_loss"], rel=1e-12)
