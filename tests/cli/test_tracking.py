"""metatrain's wandb section (petfunc.cli.tracking): the epoch metrics logged to
Weights & Biases when wandb is installed (offline here), else a warning."""

import sys

import pytest
import yaml

from petfunc.cli import main
from petfunc.cli.tracking import epoch_logger, wandb_metrics, wandb_run
from tests.helpers.cli import TINY


def test_metrics_are_grouped_as_metatrain_groups_them():
    row = {"epoch": 3, "step": 6, "learning_rate": 1e-3, "train_loss": 2.0, "val_forces_rmse": 0.5}
    assert wandb_metrics(row) == (
        3,
        {"step": 6.0, "learning_rate": 1e-3, "training/loss": 2.0, "validation/forces_rmse": 0.5},
    )


def test_without_wandb_a_warning(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    assert wandb_run({"project": "x"}, {}) is None
    assert "option 'wandb': wandb is not installed (pip install wandb" in capsys.readouterr().err
    assert wandb_run(None, {}) is None and wandb_run({"project": "x"}, {}, rank=1) is None
    with pytest.raises(ValueError, match="option 'wandb' must be a mapping of wandb.init's arguments"):
        wandb_run("x", {})


def test_wandb_errors_name_the_option(monkeypatch):
    class Refusing:
        @staticmethod
        def init(**kwargs):
            raise RuntimeError("api_key not configured")

    monkeypatch.setitem(sys.modules, "wandb", Refusing)
    with pytest.raises(ValueError, match="option 'wandb': wandb.init failed: api_key not configured"):
        wandb_run({"project": "x"}, {})


def test_epochs_are_logged_offline(tmp_path, monkeypatch, capsys):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    run = wandb_run({"project": "petfunc-test"}, {"seed": 0})
    try:
        epoch_logger(run)({"epoch": 1, "step": 2, "learning_rate": 0.1, "train_loss": 4.0})
        assert run.summary["training/loss"] == 4.0 and run.config["seed"] == 0
    finally:
        run.finish()
    # petfunc train with a wandb section: the run is logged, each epoch at its step
    out = tmp_path / "run"
    args = ["train", "-o", str(out), "--structures", "8", "--epochs", "2", *TINY]
    assert main([*args, "-r", "wandb.project=petfunc-test", "-r", f"wandb.dir={tmp_path}"]) == 0
    assert "wandb is not installed" not in capsys.readouterr().err
    assert yaml.safe_load(open(out / "options.yaml"))["wandb"]["project"] == "petfunc-test"
    runs = sorted((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 2 and runs[-1].stat().st_size > 0
