"""The phases that prepare a run, called one by one without a fit: each returns what
the next one and the loop need, and together with the loop they make ``fit``."""

import math
from pathlib import Path

import pytest
import torch

from petfunc import tree
from petfunc.data import make_batch
from petfunc.trainer import fit, loop, setup
from petfunc.trainer.checkpoints import Progress
from petfunc.trainer.processes import Processes, processes
from petfunc.trainer.run import finish
from tests.helpers.trainer import params_equal, quiet, tiny_options


def test_run_resolves_the_options_and_seeds_the_global_generators(dataset):
    options = tiny_options(dataset)
    options["base_precision"] = 64
    run = setup.run(options, log=quiet())
    # The options come back resolved, with absolute paths.
    assert run.options["training_set"]["systems"]["read_from"] == str(Path(dataset).resolve())
    assert run.options["architecture"]["training"]["checkpoint_interval"] == 100
    # dtype, device, seed and the CPU's deterministic default.
    assert (run.dtype, run.device, run.seed) == (torch.float64, torch.device("cpu"), 3)
    assert run.deterministic is True and run.checkpoint is None and run.output_dir is None
    assert run.processes == Processes()
    # The global generators start from the seed, as metatrain's do.
    first = torch.rand(3)
    setup.run(options, log=quiet())
    assert torch.equal(torch.rand(3), first)


def test_run_refuses_what_no_run_can_start_from(dataset, tmp_path):
    with pytest.raises(ValueError, match=r"fit\(\) needs options"):
        setup.run(None)
    distributed = tiny_options(dataset, distributed=True)
    with pytest.raises(ValueError, match="is true, but this is one process"):
        setup.run(distributed, log=quiet())
    # Several processes (here hooks, no process group) may set it.
    hooks = processes(0, 2, lambda g: g, lambda m: m)
    assert setup.run(distributed, log=quiet(), processes=hooks).processes.world_size == 2
    with pytest.raises(FileNotFoundError):
        setup.run(None, restart=tmp_path / "missing.ckpt")


def test_data_reads_splits_and_names_the_terms(dataset):
    run = setup.run(tiny_options(dataset), log=quiet())
    data = setup.data(run)
    # A quarter of the 16 structures validates.
    assert data.files.train_sizes == [12] and data.files.val_sizes == [4]
    assert sorted(data.files.split["training"][0] + data.files.split["validation"][0]) == list(range(16))
    assert data.terms == data.val_terms == ["energy", "forces", "stress"]
    assert data.weights.per_atom
    # A term of weight 0 is not trained, but validation reports it (it is labelled).
    run = setup.run(tiny_options(dataset, loss={"energy": {"forces": {"weight": 0}}}), log=quiet())
    data = setup.data(run)
    assert data.terms == ["energy", "stress"] and data.val_terms == ["energy", "forces", "stress"]


def test_model_holds_the_parameters_the_baselines_and_the_samples(dataset):
    run = setup.run(tiny_options(dataset, atomic_baseline={"energy": -2.0}), log=quiet())
    data = setup.data(run)
    model = setup.model(run, data)
    assert model.config.atomic_types == (13, 28, 29) and model.config.d_pet == 8
    assert [len(part) for part in model.samples] == [12, 4, 0]
    # The composition (fixed here) and the fitted scale are in the parameters, in eV.
    assert model.composition.tolist() == [-2.0, -2.0, -2.0]
    assert model.params["composition_weights"].tolist() == [-2.0, -2.0, -2.0]
    assert float(model.params["energy_scale"]) == model.scale > 0
    assert model.lora is None and model.plain(model.params) is model.params
    # What the processes of a run compare: the options but the device, and the data.
    described = setup.description(run, data, model)
    assert "device" not in described and described["seed"] == 3
    assert described["data"]["structures"] == [12, 4, 0] and described["data"]["restart"] is None
    assert described["data"]["split"] == data.files.split


def test_steps_are_built_once_and_step_without_a_fit(dataset):
    options = tiny_options(dataset)
    options["base_precision"] = 64
    run = setup.run(options, log=quiet())
    data = setup.data(run)
    model = setup.model(run, data)
    steps = setup.steps(run, data, model)
    assert (steps.steps_per_epoch, steps.start_epoch, steps.num_epochs) == (3, 0, 2)
    assert steps.progress == Progress() and steps.train is None
    assert steps.step.apply is None  # one process: the fused step
    assert steps.reduce({"loss": 1.0}) == {"loss": 1.0}
    # One step from the initial state, then the same step split in three (a
    # reduce_grads hook): the same parameters.
    batch = make_batch(model.samples.train[:4], model.config, model.composition, model.scale, torch.float64)
    initial = tree.tree_map(torch.clone, steps.state.params)
    fused, metrics = steps.step(steps.state, batch)
    assert math.isfinite(metrics["loss"]) and metrics["forces_count"] > 0
    hooked = run._replace(processes=processes(reduce_grads=lambda grads: grads))
    split = setup.steps(hooked, data, model)
    assert split.step.apply is not None
    assert params_equal(split.state.params, initial)
    state, split_metrics = split.step(split.state, batch)
    assert split_metrics["loss"] == metrics["loss"]
    assert params_equal(state.params, fused.params)


def test_folder_is_made_on_rank_0_only(dataset, tmp_path):
    options = tiny_options(dataset)
    run = setup.run(options, tmp_path / "run", log=quiet())
    data = setup.data(run)
    model = setup.model(run, data)
    assert setup.folder(run._replace(output_dir=None), data, model) is None
    other_rank = processes(1, 2, lambda g: g, lambda m: m)
    assert setup.folder(run._replace(processes=other_rank), data, model) is None
    assert not (tmp_path / "run").exists()
    folder = setup.folder(run, data, model)
    assert folder.output_dir == tmp_path / "run" and (tmp_path / "run").is_dir()
    assert sorted(folder.files) == ["best", "csv", "last", "params", "parity"]
    assert folder.interval == 100 and folder.restart_files is None
    assert list((tmp_path / "run").iterdir()) == []  # nothing is written before the first epoch


def test_phases_and_loop_make_the_fit(dataset, tmp_path):
    options = tiny_options(dataset, num_epochs=1)
    run = setup.run(options, tmp_path / "phases", log=quiet())
    data = setup.data(run)
    model = setup.model(run, data)
    steps = setup.steps(run, data, model)
    folder = setup.folder(run, data, model)
    state = loop.train(run, data, model, steps, folder)
    result = finish(run, data, model, steps, folder, state)
    expected = fit(options, tmp_path / "fit", progress=False, log=quiet())
    assert params_equal(result.last_params, expected.last_params)
    assert params_equal(result.params, expected.params) and result.best_epoch == expected.best_epoch
    assert sorted(result.files) == sorted(expected.files)
    assert [{k: v for k, v in row.items() if k != "time_s"} for row in result.history] == [
        {k: v for k, v in row.items() if k != "time_s"} for row in expected.history
    ]
