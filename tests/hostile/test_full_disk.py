"""A full disk (or quota) while petfunc writes: one error that names the file
system and the file, the previous file kept and no temporary left; the training
command ends with that line and how to continue. Portable tests make the writes
fail; one mounts a small tmpfs where it may (root on Linux) and fills it for real."""

import errno
import shutil

import pytest
import torch

import petfunc
from petfunc.cli import main
from petfunc.io import NoSpaceError, atomic_write, read_checkpoint
from tests.helpers.cli import TINY
from tests.helpers.damage import FullHandle, fill_disk_after, small_checkpoint, small_tmpfs


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir() if p.name.endswith(".tmp"))


@pytest.mark.parametrize(
    "code, words", [(errno.ENOSPC, "no space left"), (errno.EDQUOT, "disk quota exceeded")]
)
def test_atomic_write_out_of_room_keeps_the_file_and_says_where(tmp_path, code, words):
    def full(handle):
        handle.write(b"new")
        raise OSError(code, "No space left on device")

    path = tmp_path / "notes.bin"
    with pytest.raises(NoSpaceError) as caught:
        atomic_write(path, full)
    assert caught.value.errno == code and isinstance(caught.value, OSError)
    assert str(caught.value).startswith(
        f"{words} on /"
    ) and f"(writing {path}); notes.bin was not written" in str(caught.value)
    assert not path.exists() and _leftovers(tmp_path) == []
    path.write_bytes(b"old")
    with pytest.raises(NoSpaceError, match=rf"\(writing {path}\); notes.bin is unchanged$"):
        atomic_write(path, full)
    with pytest.raises(NoSpaceError, match="; the previous checkpoint notes.bin is kept$"):
        atomic_write(path, full, what="checkpoint")
    assert path.read_bytes() == b"old" and _leftovers(tmp_path) == []


def test_a_full_disk_in_torch_save_is_said_so_and_the_previous_checkpoint_kept(tmp_path, monkeypatch):
    last = small_checkpoint(tmp_path / "last.ckpt", epoch=1)
    fill_disk_after(monkeypatch, room=64)
    with pytest.raises(
        NoSpaceError,
        match=rf"^no space left on /.* \(writing {last}\); the previous checkpoint last.ckpt is kept$",
    ):
        small_checkpoint(last, epoch=2)
    with pytest.raises(NoSpaceError, match="best_params.pt was not written"):
        petfunc.save_params(tmp_path / "best_params.pt", *petfunc.load_model(last))
    monkeypatch.undo()
    assert read_checkpoint(last)["epoch"] == 1 and _leftovers(tmp_path) == []


def test_torch_writer_errors_count_as_a_full_disk_only_without_room(tmp_path, monkeypatch):
    """torch.save to a path reports a full disk as its own RuntimeError, with no OSError
    behind it: that is taken for a full disk only where the folder has no room left."""

    def torch_full(handle):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 64 vs 0")

    with pytest.raises(RuntimeError, match="unexpected pos"):
        atomic_write(tmp_path / "a.ckpt", torch_full)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage._replace(free=4096))
    with pytest.raises(NoSpaceError, match="no space left on .*a.ckpt was not written") as caught:
        atomic_write(tmp_path / "a.ckpt", torch_full)
    assert isinstance(caught.value.__cause__, RuntimeError) and _leftovers(tmp_path) == []


def test_full_handle_runs_out_of_room(tmp_path):
    with open(tmp_path / "f", "wb") as handle, FullHandle(handle, room=4) as full:
        full.write(b"1234")
        with pytest.raises(OSError, match="No space left"):
            full.write(b"5")


def test_training_ends_with_one_line_and_continues_once_there_is_room(tmp_path, capsys, monkeypatch):
    run = tmp_path / "run"
    # the disk fills once the first last.ckpt is written: best.ckpt finds no room
    fill_disk_after(monkeypatch, room=0, when=lambda: (run / "last.ckpt").exists())
    argv = ["train", "--output", str(run), "--structures", "8", "--epochs", "2", *TINY]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    mount = err.split(" on ", 1)[1].split(" ")[0]
    assert err == (
        f"petfunc: error: no space left on {mount} (writing {run / 'best.ckpt'}); best.ckpt was not "
        f"written; once there is room, continue the run with --restart {run / 'last.ckpt'} (epoch 1)\n"
    ), err
    assert _leftovers(run) == [] and read_checkpoint(run / "last.ckpt")["epoch"] == 1
    monkeypatch.undo()
    assert main(["train", "--restart", str(run / "last.ckpt"), "--no-progress"]) == 0
    assert read_checkpoint(run / "last.ckpt")["epoch"] == 2 and read_checkpoint(run / "best.ckpt")


def test_a_real_full_tmpfs(tmp_path):
    """Checkpoints into a tmpfs with room for one and a half: the second finds no room
    (torch's writer fails), the first stays readable, and the temporary is gone."""
    probe = small_checkpoint(tmp_path / "probe.ckpt", epoch=1)
    size = probe.stat().st_size
    with small_tmpfs(tmp_path / "mnt", f"{(3 * size // 2) // 4096 * 4096 + 4096}") as disk:
        small_checkpoint(disk / "last.ckpt", epoch=1)
        with pytest.raises(NoSpaceError) as caught:
            small_checkpoint(disk / "last.ckpt", epoch=2)
        assert caught.value.errno == errno.ENOSPC
        assert str(caught.value) == (
            f"no space left on {disk} (writing {disk / 'last.ckpt'}); "
            "the previous checkpoint last.ckpt is kept"
        )
        assert read_checkpoint(disk / "last.ckpt")["epoch"] == 1 and _leftovers(disk) == []
        torch.save({"room": torch.zeros(8)}, disk / "small.pt")  # the temporary's room came back
