"""The lock of a run folder: the holder written into it, a second holder refused with
its name, a lock the OS released (a killed holder) taken over, the same thread
taking it again, every release removing it, and file systems without locks."""

import errno
import fcntl
import json
import os
import socket
import threading

import pytest

from petfunc.trainer import lock as folder_lock
from petfunc.trainer.lock import (
    LOCK_NAME,
    FolderInUseError,
    holds_lock,
    lock_folder,
    lock_output_folder,
    read_holder,
)


def other_holder(folder, pid=4242, host="node7"):
    """The lock of ``folder`` held through a descriptor of its own, as another process
    holds it (flock locks of two open files conflict within one process too);
    returns the descriptor (close it to release)."""
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"pid": pid, "host": host, "started": "2025-01-02T03:04:05+00:00", "command": "petfunc train"}
    os.write(fd, json.dumps(holder).encode())
    return fd


def test_the_lock_names_its_holder_and_goes_with_its_release(tmp_path):
    folder = tmp_path / "a" / "run"
    with lock_folder(folder, command="petfunc train o.yaml") as lock:
        assert lock.exclusive and holds_lock(folder)
        holder = read_holder(folder)
        assert holder.pid == os.getpid() and holder.host == socket.gethostname()
        assert holder.command == "petfunc train o.yaml" and holder.started[:2] == "20"
        assert "petfunc train o.yaml (pid" in holder.describe()
    assert not holds_lock(folder)
    assert not (tmp_path / "a").exists()  # the folders it made, left empty, go too
    folder.mkdir(parents=True)
    with lock_folder(folder):
        (folder / "last.ckpt").write_bytes(b"x")
    assert [p.name for p in folder.iterdir()] == ["last.ckpt"]  # the lock file goes, the run's files stay


def test_a_held_folder_is_refused_with_the_holders_name(tmp_path):
    fd = other_holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError) as refused:
            lock_folder(tmp_path)
        message = str(refused.value)
        assert (
            f"the run folder {str(tmp_path)!r} is in use by petfunc train (pid 4242 on host node7" in message
        )
        assert "started 2025-01-02T03:04:05+00:00" in message and "-o/--output" in message
        assert isinstance(refused.value, ValueError)  # petfunc train: "petfunc: error: ..."
        assert not holds_lock(tmp_path)
    finally:
        os.close(fd)
    assert (tmp_path / LOCK_NAME).exists()  # the refused caller removes no lock of another's


def test_a_holder_not_written_yet_is_still_refused(tmp_path):
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    try:
        with pytest.raises(FolderInUseError, match="in use by another process"):
            lock_folder(tmp_path)
    finally:
        os.close(fd)


def test_a_lock_its_holder_left_is_taken_over(tmp_path):
    """A killed holder's lock file stays, but the OS released its flock: the next
    run takes the folder and says whose lock it was."""
    os.close(other_holder(tmp_path, pid=999))
    lines = []
    with lock_folder(tmp_path, log=lines.append):
        assert read_holder(tmp_path).pid == os.getpid()
    assert len(lines) == 1 and "from a run that ended without releasing it" in lines[0]
    assert "pid 999 on host node7" in lines[0]
    assert not (tmp_path / LOCK_NAME).exists()


def test_the_same_thread_takes_it_again_another_thread_is_refused(tmp_path):
    outer = lock_folder(tmp_path, command="petfunc train")
    inner = lock_folder(tmp_path)  # fit inside petfunc train
    assert inner is outer
    refusals = []

    def other_thread():
        try:
            lock_folder(tmp_path)
        except FolderInUseError as error:
            refusals.append(str(error))

    thread = threading.Thread(target=other_thread)
    thread.start()
    thread.join()
    assert len(refusals) == 1 and "another thread of this process" in refusals[0]
    assert f"pid {os.getpid()}" in refusals[0]
    inner.release()
    assert holds_lock(tmp_path)  # the outer taking still holds it
    outer.release()
    outer.release()  # a released lock: nothing
    assert not holds_lock(tmp_path) and not (tmp_path / LOCK_NAME).exists()


def test_a_file_system_without_locks_runs_unlocked_with_a_warning(tmp_path, monkeypatch):
    def no_locks(fd, operation):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(folder_lock.fcntl, "flock", no_locks)
    lines = []
    with lock_folder(tmp_path / "run", log=lines.append) as lock:
        assert not lock.exclusive and not holds_lock(tmp_path / "run")
        assert not (tmp_path / "run" / LOCK_NAME).exists()
    assert len(lines) == 1 and lines[0].startswith(f"warning: cannot lock the run folder {tmp_path / 'run'}")
    assert "No locks available" in lines[0] and "is not refused" in lines[0]


def test_the_output_folder_is_locked_by_the_writing_process_only(tmp_path):
    with lock_output_folder(tmp_path / "run", is_main=False):
        assert not (tmp_path / "run").exists()  # another rank: no folder, no lock
    with lock_output_folder(None, is_main=True):
        pass
    with lock_output_folder(tmp_path / "run", is_main=True):
        assert holds_lock(tmp_path / "run")
    assert not (tmp_path / "run").exists()
    fd = other_holder(tmp_path)
    try:
        with pytest.raises(FolderInUseError, match="pid 4242"):
            lock_output_folder(tmp_path, is_main=True)
    finally:
        os.close(fd)


def test_an_unreadable_holder_is_none(tmp_path):
    assert read_holder(tmp_path) is None
    (tmp_path / LOCK_NAME).write_text("not json")
    assert read_holder(tmp_path) is None


def test_a_lock_file_that_is_a_link_is_never_followed(tmp_path):
    target = tmp_path / "precious.txt"
    target.write_text("keep")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_NAME).symlink_to(target)
    with pytest.raises(ValueError, match="is a symbolic link, not petfunc's: remove it"):
        lock_folder(run)
    assert target.read_text() == "keep"


def test_a_holders_text_is_printable_in_the_refusal(tmp_path):
    fd = os.open(tmp_path / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    holder = {"pid": 7, "host": "h\x1b[2J", "started": "t", "command": "x" * 500}
    os.write(fd, json.dumps(holder).encode())
    try:
        with pytest.raises(FolderInUseError) as refused:
            lock_folder(tmp_path)
    finally:
        os.close(fd)
    message = str(refused.value)
    assert "\x1b" not in message and "host h?[2J" in message and "x" * 201 not in message
