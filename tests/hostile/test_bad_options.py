"""Options and flags that name no valid setting: a misspelt target, a target that
is not an energy, NaN and infinite numbers, a CUDA device this process cannot use.
Each is an error (``petfunc: error: ...``, status 2) that names the option and
the value, before any file is written."""

import pytest
import torch
import yaml

from petfunc.cli import main, make_default_dataset
from petfunc.export import export
from petfunc.io import save_params
from petfunc.trainer import evaluate
from tests.helpers.cli import TINY
from tests.helpers.io_setup import small_config, small_params


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """Four EMT structures with energies, forces and stresses."""
    return make_default_dataset(tmp_path_factory.mktemp("data") / "emt.xyz", n_structures=4, seed=2)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """A small untrained PET as a best_params.pt file."""
    path = tmp_path_factory.mktemp("model") / "best_params.pt"
    config = small_config()
    save_params(path, config, small_params(config))
    return path


def train_with_targets(tmp_path, data, targets) -> int:
    """``petfunc train`` of a tiny model on ``data`` with the dataset's ``targets``."""
    options = tmp_path / "options.yaml"
    options.write_text(yaml.safe_dump({"training_set": {"systems": str(data), "targets": targets}}))
    return main(["train", str(options), "-o", str(tmp_path / "run"), "--epochs", "1", *TINY])


def assert_refused(code, capsys, *texts, output=None):
    """Status 2, ``petfunc: error:`` with each of ``texts``, and no run folder left."""
    err = capsys.readouterr().err
    assert code == 2, err
    assert "petfunc: error: " in err
    for text in texts:
        assert text in err, err
    if output is not None:
        assert not output.exists()


def test_misspelt_target(tmp_path, data, capsys):
    """``enrgy`` would be a target of its own: forces and stress off, energies only."""
    code = train_with_targets(tmp_path, data, {"enrgy": {"key": "energy"}})
    assert_refused(
        code,
        capsys,
        "option 'training_set.targets.enrgy': unknown target name 'enrgy' (did you mean 'energy'?)",
        output=tmp_path / "run",
    )


@pytest.mark.parametrize(
    "targets, text",
    [
        (
            {"non_conservative_force": {}},
            "is a standard output petfunc does not train; petfunc trains energies",
        ),
        ({"mtt::dipole": {"type": {"cartesian": {"rank": 1}}}}, "must be 'scalar' (petfunc trains total"),
        ({"mtt::dipole": {"quantity": "dipole"}}, "must be 'energy' (petfunc trains total energies)"),
        ({"dipole::x": {}}, "target names with '::' must start with 'mtt::'"),
        ({"forces": {}}, "'forces' looks like a derivative of the energy"),
    ],
)
def test_targets_petfunc_does_not_train(tmp_path, data, capsys, targets, text):
    assert_refused(train_with_targets(tmp_path, data, targets), capsys, text, output=tmp_path / "run")


def test_a_target_of_another_name_warns_of_unused_forces(tmp_path, data, capsys):
    """``mtt::E`` reads no forces or stress by default (as in metatrain): it trains,
    and the log says which labels of the file it leaves out."""
    assert train_with_targets(tmp_path, data, {"mtt::E": {"key": "energy"}}) == 0
    out = capsys.readouterr().out
    for label in ("forces", "stress"):
        assert f"have {label} labels (key '{label}'), but the loss leaves them out" in out, out


@pytest.mark.parametrize(
    "flags, text",
    [
        (
            ["--set", "architecture.training.learning_rate=.nan"],
            "option 'architecture.training.learning_rate' must be a finite number, got nan",
        ),
        (["--lr", "inf"], "option 'architecture.training.learning_rate' must be a finite number, got inf"),
        (
            ["--set", "architecture.training.num_epochs=.inf"],
            "option 'architecture.training.num_epochs' must be a finite number, got inf",
        ),
        (
            ["--set", "architecture.training.grad_clip_norm=.inf"],
            "option 'architecture.training.grad_clip_norm' must be a finite number, got inf",
        ),
        (
            ["--set", "architecture.training.loss={energy: {forces: .nan}}"],
            "option 'architecture.training.loss.energy.forces' must be a finite number, got nan",
        ),
        (["--set", "validation_set=.nan"], "option 'validation_set' must be a finite number, got nan"),
        (
            ["--set", "architecture.model.cutoff=.inf"],
            "option 'architecture.model': cutoff must be finite, got inf",
        ),
        (
            ["--set", "architecture.model.cutoff_width=.nan"],
            "option 'architecture.model': cutoff_width must be a positive number, got nan",
        ),
        (
            ["--set", "architecture.model.long_range={enable: true, smearing: .inf}"],
            "option 'architecture.model': long_range.smearing must be finite, got inf",
        ),
    ],
)
def test_nan_and_inf_options(tmp_path, capsys, flags, text):
    """The demo run (no options file): refused before its dataset is written."""
    output = tmp_path / "run"
    code = main(["train", "-o", str(output), "--epochs", "1", *TINY, *flags])
    assert_refused(code, capsys, text, output=output)


def cpu_only_torch(monkeypatch):
    """This process as a CPU-only build of torch sees it, on any machine."""
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def commands(tmp_path, data, model, device):
    """Each command asked for ``device``: ``(argv, how errors name the request,
    output folder or None)``."""
    run = tmp_path / "run"
    flag, option = f"--device {device}", f"option 'device' is {device!r}"
    return [
        (["train", "-o", str(run), "--epochs", "1", *TINY, "--device", device], flag, run),
        (["train", "-o", str(run), "--epochs", "1", *TINY, "--set", f"device={device}"], option, run),
        (["eval", str(model), str(data), "--device", device], flag, None),
        (["export", str(model), str(tmp_path / "m.pt2"), "--no-aoti", "--device", device], flag, None),
    ]


def test_cuda_on_a_torch_without_cuda(tmp_path, data, model, capsys, monkeypatch):
    """``AssertionError: Torch not compiled with CUDA enabled`` named nothing."""
    cpu_only_torch(monkeypatch)
    for argv, asked, output in commands(tmp_path, data, model, "cuda"):
        text = f"{asked}: this torch has no CUDA (torch {torch.__version__})"
        assert_refused(main(argv), capsys, text, output=output)
    assert not (tmp_path / "m.pt2").exists()


def test_cuda_with_no_device_visible(tmp_path, data, model, capsys, monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv, asked, output in commands(tmp_path, data, model, "cuda:0"):
        assert_refused(main(argv), capsys, f"{asked}: no CUDA device is visible", output=output)


def test_library_calls_check_the_device(tmp_path, data, model, monkeypatch):
    """petfunc.export.export and petfunc.trainer.evaluate, called from Python, name
    the missing CUDA as the commands do."""
    cpu_only_torch(monkeypatch)
    config = small_config()
    with pytest.raises(ValueError, match=r"^device is 'cuda': this torch has no CUDA"):
        export(config, small_params(config), tmp_path / "m.pt2", device="cuda", aoti=False)
    with pytest.raises(ValueError, match=r"^device is 'cuda:0': this torch has no CUDA"):
        evaluate(model, data, device="cuda:0")
    assert not (tmp_path / "m.pt2").exists()
