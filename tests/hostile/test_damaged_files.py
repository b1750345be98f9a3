"""Damaged files through every loader of petfunc: a flipped bit in a tensor or a
number (bit rot), and truncated, random and empty files. Each gives one error that
names the file, says what is wrong and what to use instead, never a silently wrong
model or a traceback of torch's internals."""

import pytest
import torch

import petfunc
from petfunc.ase.calculator import PETCalculator
from petfunc.cli import main
from petfunc.io import load_model, load_params, read_checkpoint
from petfunc.io.digest import DamagedFileError
from tests.helpers.damage import (
    empty_file,
    flip_bit_in_float,
    flip_bit_in_tensor,
    random_file,
    small_checkpoint,
    truncate,
    without_digest,
)


WEIGHT = "edge_embedder.weight"


def _structures(tmp_path):
    import ase
    import ase.io

    path = tmp_path / "water.xyz"
    ase.io.write(path, ase.Atoms("OH2", positions=[[0, 0, 0], [0.96, 0, 0], [-0.24, 0.93, 0]]))
    return path


def _run_folder(tmp_path):
    """A run's folder: epoch_2.ckpt, then last.ckpt (epoch 3), written in that order."""
    run = tmp_path / "run"
    run.mkdir()
    small_checkpoint(run / "epoch_2.ckpt", epoch=2)
    return run, small_checkpoint(run / "last.ckpt", epoch=3)


def test_a_flipped_bit_in_a_checkpoint_tensor_is_refused_with_the_intact_one_named(tmp_path):
    run, last = _run_folder(tmp_path)
    weight = read_checkpoint(last)["params"][WEIGHT]
    flip_bit_in_tensor(last, weight, element=1)
    damaged = torch.load(last, weights_only=True)["params"][WEIGHT]  # torch checks no checksum
    assert abs(damaged.view(-1)[1].item()) > 1e30
    message = rf"'{last}' is damaged: its content does not match the digest .*bit rot"
    instead = rf"newest intact checkpoint beside it is '{run / 'epoch_2.ckpt'}' \(epoch 2\)"
    for load in (read_checkpoint, load_model, PETCalculator.from_checkpoint):
        with pytest.raises(DamagedFileError, match=message) as caught:
            load(last)
        assert caught.match(instead)


def test_a_flipped_bit_in_a_pickled_number_is_refused(tmp_path):
    _, last = _run_folder(tmp_path)
    flip_bit_in_float(last, 0.5)  # the energy scale, a plain float of the pickle
    assert torch.load(last, weights_only=True)["energy_scale"] != 0.5
    with pytest.raises(DamagedFileError, match="last.ckpt' is damaged"):
        read_checkpoint(last)


def test_a_flipped_bit_in_a_parameter_file_is_refused(tmp_path):
    run, last = _run_folder(tmp_path)
    config, params = load_model(last)
    petfunc.save_params(run / "best_params.pt", config, params)
    flip_bit_in_tensor(run / "best_params.pt", params["edge_embedder"]["weight"])
    for load in (load_params, load_model, PETCalculator.from_checkpoint):
        with pytest.raises(DamagedFileError, match=r"best_params.pt' is damaged.*beside it is '.*last.ckpt'"):
            load(run / "best_params.pt")


def test_files_written_before_the_digest_load_unchecked(tmp_path):
    _, last = _run_folder(tmp_path)
    without_digest(last)
    flip_bit_in_tensor(last, read_checkpoint(last)["params"][WEIGHT])
    assert abs(read_checkpoint(last)["params"][WEIGHT].view(-1)[0].item()) > 1e30


def test_the_commands_refuse_a_flipped_bit_in_one_line(tmp_path, capsys):
    run, last = _run_folder(tmp_path)
    flip_bit_in_tensor(last, read_checkpoint(last)["params"][WEIGHT])
    for argv in (["eval", str(last), str(_structures(tmp_path))], ["train", "--restart", str(last)]):
        capsys.readouterr()
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"petfunc: error: '{last}' is damaged") and err.count("\n") == 1, err
        assert f"'{run / 'epoch_2.ckpt'}' (epoch 2)" in err
    assert not (run / "options.yaml").exists()  # the restart wrote nothing


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda path: truncate(path, 0.5), "cut short"),
        (lambda path: truncate(path, 0.999), "cut short"),
        (lambda path: random_file(path), "not a torch file"),
        (empty_file, "it is empty"),
    ],
    ids=["half", "last-bytes", "random", "empty"],
)
def test_truncated_random_and_empty_files_through_every_loader(tmp_path, capsys, damage, words):
    run, last = _run_folder(tmp_path)
    config, params = load_model(last)
    petfunc.save_params(run / "best_params.pt", config, params)
    for path in (last, run / "best_params.pt"):
        damage(path)
        loaders = [load_model, load_params, PETCalculator.from_checkpoint]
        if path.suffix == ".ckpt":
            loaders.append(read_checkpoint)
        for load in loaders:
            with pytest.raises(ValueError, match=rf"'{path}' is not a .*{words}"):
                load(path)
        commands = [["eval", str(path), str(_structures(tmp_path))]]
        if path.suffix == ".ckpt":
            commands.append(["train", "--restart", str(path)])
        for argv in commands:
            capsys.readouterr()
            assert main(argv) == 2, argv
            err = capsys.readouterr().err
            assert err.startswith(f"petfunc: error: '{path}' is not a") and words in err, err
            assert err.count("\n") == 1 and "Traceback" not in err, err
    with pytest.raises(ValueError, match=r"beside it is '.*epoch_2.ckpt' \(epoch 2\)"):
        read_checkpoint(last)
