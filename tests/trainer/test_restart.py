"""Restarts: exact resume, the split kept, edited files noticed, another number of
processes or steps per epoch.
"""

import json

import pytest
import torch

from petfunc.io import read_checkpoint
from petfunc.io.digest import with_digest
from petfunc.trainer import fit
from tests.helpers.trainer import params_equal, quiet, tiny_options


def test_exact_resume_float64(dataset, tmp_path):
    # Uninterrupted: 3 epochs, with a checkpoint after every epoch.
    options = tiny_options(dataset, num_epochs=3, checkpoint_interval=1)
    options["base_precision"] = 64
    full = fit(options, tmp_path / "full", progress=False, log=quiet())
    # Continue from the checkpoint of epoch 1 in another folder.
    resumed = fit(
        None, tmp_path / "resumed", restart=tmp_path / "full" / "epoch_1.ckpt", progress=False, log=quiet()
    )
    assert params_equal(full.last_params, resumed.last_params), "resumed parameters differ"
    assert params_equal(full.params, resumed.params) and full.best_epoch == resumed.best_epoch
    assert [r["epoch"] for r in resumed.history] == [1, 2, 3]
    for a, b in zip(full.history, resumed.history):
        assert a["train_loss"] == b["train_loss"] and a["val_loss"] == b["val_loss"]
    a = read_checkpoint(tmp_path / "full" / "last.ckpt")["opt_state"]
    b = read_checkpoint(tmp_path / "resumed" / "last.ckpt")["opt_state"]
    leaves_a, leaves_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    assert len(leaves_a) == len(leaves_b)
    for x, y in zip(leaves_a, leaves_b):
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y


def test_restart_keeps_the_split(dataset, tmp_path):
    """Checkpoints store the file indices of the training and validation structures
    and a restart reads them (so a change of the split rule never moves structures
    between the sets of a running training); checkpoints without them get the rule
    of the versions that wrote them; a file that changed size is an error."""
    import ase.io

    fit(tiny_options(dataset, num_epochs=1), tmp_path / "run", progress=False, log=quiet())
    ckpt = read_checkpoint(tmp_path / "run" / "last.ckpt")
    train, val = ckpt["split"]["training"][0], ckpt["split"]["validation"][0]
    assert len(val) == 4 and sorted(train + val) == list(range(16))

    def restart_sizes(split):
        ckpt["split"] = split
        torch.save(with_digest(ckpt), tmp_path / "edited.ckpt")
        lines = []
        options = json.loads(ckpt["options"])
        options["architecture"]["training"]["num_epochs"] = 2
        fit(
            options,
            tmp_path / "restarted",
            restart=tmp_path / "edited.ckpt",
            progress=False,
            log=quiet(lines),
        )
        return next(line for line in lines if line.startswith("training set:"))

    assert "training set: 10 structures (160 atoms), validation set: 6" in restart_sizes(
        {"training": [train[:-2]], "validation": [val + train[-2:]]}
    )
    # legacy checkpoints: round(0.25 * 16) = 4 validation structures
    assert "validation set: 4 structures" in restart_sizes(None)
    ckpt["split"] = {"training": [train], "validation": [val]}
    torch.save(with_digest(ckpt), tmp_path / "edited.ckpt")
    # options asking for another split are an error, not ignored
    for name, value, message in (
        ("validation_set", 0.5, "'validation_set' is 0.5 here, 0.25 in the run"),
        ("test_set", 0.1, "'test_set' is 0.1 here, 0 in the run"),
        ("validation_set", str(dataset), "is a separate file here, 0.25 in the run"),
    ):
        options = json.loads(ckpt["options"])
        options[name] = value
        options["architecture"]["training"]["num_epochs"] = 2
        with pytest.raises(ValueError, match=message):
            fit(options, tmp_path / "resplit", restart=tmp_path / "edited.ckpt", progress=False, log=quiet())
    assert not (tmp_path / "resplit").exists() or not any((tmp_path / "resplit").iterdir())
    ase.io.write(tmp_path / "fewer.xyz", ase.io.read(dataset, ":10"))
    options = json.loads(ckpt["options"])
    options["training_set"]["systems"]["read_from"] = str(tmp_path / "fewer.xyz")
    options["architecture"]["training"]["num_epochs"] = 2
    with pytest.raises(ValueError, match=r"training data changed since the checkpoint.*\[16\].*\[10\]"):
        fit(options, tmp_path / "changed", restart=tmp_path / "edited.ckpt", progress=False, log=quiet())


def test_restart_notices_an_edited_training_file(dataset, tmp_path):
    """The number of structures is not all: a label edited since the checkpoint is
    named in a warning (the restart trains on the file as it is)."""
    import ase.io

    edited = tmp_path / "data.xyz"
    edited.write_bytes(open(dataset, "rb").read())
    fit(tiny_options(edited, num_epochs=1), tmp_path / "run", progress=False, log=quiet())
    lines = []
    fit(
        tiny_options(edited, num_epochs=2),
        tmp_path / "run",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert not any("training_set changed since the checkpoint" in line for line in lines)
    frames = ase.io.read(edited, ":")
    frames[5].calc.results["energy"] += 0.1
    ase.io.write(edited, frames)
    lines = []
    fit(
        tiny_options(edited, num_epochs=3),
        tmp_path / "run",
        restart=tmp_path / "run" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any(line.startswith("warning: training_set changed since the checkpoint") for line in lines), lines
    # a separate validation file too (it picks the best epoch)
    validation = tmp_path / "validation.xyz"
    ase.io.write(validation, frames[:4])
    options = tiny_options(edited, num_epochs=1)
    options["validation_set"] = str(validation)
    fit(options, tmp_path / "separate", progress=False, log=quiet())
    frames[0].calc.results["energy"] -= 0.1
    ase.io.write(validation, frames[:4])
    options["architecture"]["training"]["num_epochs"] = 2
    lines = []
    fit(
        options,
        tmp_path / "separate",
        restart=tmp_path / "separate" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any(line.startswith("warning: validation_set changed since the checkpoint") for line in lines), (
        lines
    )


def test_restart_with_other_processes_names_the_batch_size(dataset, tmp_path):
    """Checkpoints store their number of processes, so a restart with another one
    that takes other batches says which --batch-size gives the same global batches."""
    fit(tiny_options(dataset, num_epochs=1), tmp_path / "one", progress=False, log=quiet())
    assert read_checkpoint(tmp_path / "one" / "last.ckpt")["world_size"] == 1
    lines = []
    fit(
        None,
        tmp_path / "two",
        restart=tmp_path / "one" / "last.ckpt",
        progress=False,
        log=quiet(lines),
        rank=0,
        world_size=2,
        reduce_grads=lambda g: g,
        reduce_metrics=lambda m: m,
    )
    options = json.loads(read_checkpoint(tmp_path / "one" / "last.ckpt")["options"])
    assert options["architecture"]["training"]["batch_size"] == 4
    warning = next(line for line in lines if "steps in 1 epochs" in line)
    assert (
        "the checkpoint's 1 process took batches of 4 structures in all: --batch-size 2 gives the same with 2"
        in warning
    )


def test_restart_with_other_steps_per_epoch_ends_the_schedule(dataset, tmp_path):
    """A restart that takes another number of steps per epoch (another number of
    processes, batch packing or batch size): the learning rate still decays to the
    end of the run (the schedule's length was recomputed from the new steps per
    epoch only, so it ran out early, or stopped short of zero), with a warning."""
    options = tiny_options(dataset, num_epochs=2, batch_size=4, warmup_fraction=0.0)
    fit(options, tmp_path / "first", progress=False, log=quiet())
    options["architecture"]["training"].update(num_epochs=4, batch_size=2)
    lines = []
    result = fit(
        options,
        tmp_path / "second",
        restart=tmp_path / "first" / "last.ckpt",
        progress=False,
        log=quiet(lines),
    )
    assert any("fitted to end with epoch 4" in line for line in lines), lines
    rates = [row["learning_rate"] for row in result.history]
    peak = options["architecture"]["training"]["learning_rate"]
    assert rates[2] > 0.1 * peak and 0 < rates[3] < 0.05 * peak, rates
