"""Two runs writing one output folder: the second is refused with the first's name,
leaving the folder and the first's in-flight files alone; the lock of a run killed
with SIGKILL is taken over; every way a run ends releases the folder."""

import signal
import subprocess
import sys

import pytest

from petfunc.cli import main, make_default_dataset
from petfunc.trainer import fit
from petfunc.trainer.lock import LOCK_NAME, FolderInUseError, lock_folder, read_holder
from tests.helpers.cli import TINY
from tests.helpers.dist_launch import free_port, rank_env
from tests.helpers.folder_lock import HOLDER_COMMAND, holding_process
from tests.helpers.trainer import quiet, tiny_options


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    """8 EMT structures."""
    return make_default_dataset(tmp_path_factory.mktemp("data") / "emt.xyz", n_structures=8, seed=1)


def contents(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def test_a_second_run_is_refused_and_touches_nothing(dataset, tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "options.yaml").write_text("the first run's options\n")
    (run / "last.ckpt").write_bytes(b"the first run's checkpoint")
    in_flight = run / ".best.ckpt.k3j_x1.tmp"  # the first run writing best.ckpt
    in_flight.write_bytes(b"half a checkpoint")
    with holding_process(run) as first:
        before = contents(run)
        with pytest.raises(FolderInUseError) as refused:
            fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet())
        assert f"in use by {HOLDER_COMMAND} (pid {first.pid} on host" in str(refused.value)
        assert contents(run) == before and in_flight.exists()
        assert main(["train", "-s", f"training_set={dataset}", "-o", str(run), *TINY]) == 2
        err = capsys.readouterr().err
        assert (
            f"petfunc: error: the run folder {str(run)!r} is in use by {HOLDER_COMMAND} (pid {first.pid}"
            in err
        )
        assert "choose another output folder (petfunc train -o/--output" in err
        assert contents(run) == before  # its options.yaml not replaced, nothing removed
        assert first.poll() is None  # the first run lives on
    assert read_holder(run).pid == first.pid  # what the killed holder left


def test_the_lock_of_a_killed_run_is_taken_over(dataset, tmp_path):
    run = tmp_path / "run"
    with holding_process(run) as first:
        # SIGKILL while writing last.ckpt: its temporary file stays, and its lock file
        (run / ".last.ckpt.a8.tmp").write_bytes(b"partial")
        first.send_signal(signal.SIGKILL)
        first.wait()
    lines = []
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=lines.append)
    assert any(f"pid {first.pid}" in line and "ended without releasing it" in line for line in lines)
    assert any("removed 1 temporary file(s)" in line for line in lines)
    assert not (run / ".last.ckpt.a8.tmp").exists() and (run / "last.ckpt").is_file()
    assert not (run / LOCK_NAME).exists()


def test_every_end_of_a_run_releases_the_folder(dataset, tmp_path):
    run = tmp_path / "run"
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet())
    assert not (run / LOCK_NAME).exists()
    lock_folder(run).release()  # free again

    def failing_log(message):
        if message.startswith("epoch"):
            raise RuntimeError("the log failed")

    with pytest.raises(RuntimeError, match="the log failed"):
        fit(tiny_options(dataset, num_epochs=2), run / "again", progress=False, log=failing_log)
    assert (run / "again" / "last.ckpt").is_file() and not (run / "again" / LOCK_NAME).exists()
    lock_folder(run / "again").release()
    options = tiny_options(dataset, num_epochs=1)
    options["training_set"] = str(tmp_path / "missing.xyz")
    with pytest.raises(FileNotFoundError):
        fit(options, tmp_path / "never", progress=False, log=quiet())
    assert not (tmp_path / "never").exists()  # the folder the lock made, left empty, goes


def test_every_rank_of_a_data_parallel_run_is_refused(dataset, tmp_path):
    """Under torchrun rank 0 alone locks the folder (the ranks of one run never refuse
    each other); its refusal reaches every rank, which stops at once."""
    run = tmp_path / "run"
    port = free_port()
    command = [sys.executable, "-m", "petfunc", "train", "-s", f"training_set={dataset}", "-o", str(run)]
    with holding_process(run) as first:
        ranks = [
            subprocess.Popen(
                command + TINY + ["--threads", "1"],
                env=rank_env(rank, 2, port, PETFUNC_DIST_TIMEOUT="60"),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for rank in range(2)
        ]
        try:
            errors = [rank.communicate(timeout=120)[1] for rank in ranks]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
        assert [rank.returncode for rank in ranks] == [2, 2], errors[0][-2000:] + errors[1][-2000:]
        for err in errors:
            assert f"is in use by {HOLDER_COMMAND} (pid {first.pid}" in err, err[-2000:]
        assert sorted(p.name for p in run.iterdir()) == [LOCK_NAME]
