"""The log of a run: every console line also in ``train.log`` after a header (versions,
device, dtype, threads, command, folder, units), appended by a restart, closed on
every exit, never written by a run the folder's lock refused, and kept apart from
another thread's run."""

import logging
import os
import platform
import threading

import pytest
import torch

import petfunc
from petfunc.trainer import fit
from petfunc.trainer.lock import FolderInUseError
from petfunc.trainer.runlog import LOG_NAME, RunLog, say
from tests.helpers.runlog import hold_folder, petfunc_handlers
from tests.helpers.trainer import quiet, tiny_options


def test_train_log_has_the_header_and_every_console_line(dataset, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="petfunc")
    lines = []
    fit(tiny_options(dataset, num_epochs=1), tmp_path / "run", progress=False, log=quiet(lines))
    text = (tmp_path / "run" / LOG_NAME).read_text(encoding="utf-8")
    head = text.split("training set:")[0]
    for field in (
        f"petfunc training run in {tmp_path / 'run'}",
        f"petfunc {petfunc.__version__}",
        f"torch {torch.__version__}",
        f"Python {platform.python_version()}",
        "device: cpu; dtype float32",
        f"{torch.get_num_threads()} threads; 1 process",
        "command: ",
        "E (energy_*) energy per atom, eV/atom; F (forces_*) eV/Å",
        "stress eV/Å³",
    ):
        assert field in head, field
    assert any(line.startswith("epoch    1/1") for line in lines)
    for line in lines:  # the console's lines, each with its time and level
        assert f"[INFO] - {line}\n" in text, line
    assert not petfunc_handlers() and logging.getLogger("petfunc").level == logging.INFO  # caplog's
    assert [r.getMessage() for r in caplog.records if r.name == "petfunc.trainer"] == lines


def test_a_restart_appends_after_a_line_that_names_it(dataset, tmp_path):
    run = tmp_path / "run"
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet())
    first = (run / LOG_NAME).read_text(encoding="utf-8")
    lines = []
    fit(tiny_options(dataset, num_epochs=2), restart=run / "last.ckpt", progress=False, log=quiet(lines))
    text = (run / LOG_NAME).read_text(encoding="utf-8")
    assert text.startswith(first)
    added = text[len(first) :].splitlines()
    assert added[0].endswith(f"restart from {run / 'last.ckpt'} {'=' * 20}")
    assert f"restarted from {run / 'last.ckpt'}" in added[1]
    assert any(line.endswith(next(m for m in lines if m.startswith("epoch    2/2"))) for line in added)
    # a new run into the folder starts it afresh
    fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet())
    assert "restart from" not in (run / LOG_NAME).read_text(encoding="utf-8")
    assert not petfunc_handlers() and logging.getLogger("petfunc").level == logging.NOTSET


def test_the_log_is_closed_when_the_run_stops(dataset, tmp_path):
    """A caller's console raising (Ctrl-C) mid-run: that line and the reason are the
    file's last, and no handler stays on the petfunc loggers."""

    def stop_at_the_epoch(message):
        if message.startswith("epoch "):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        fit(tiny_options(dataset, num_epochs=1), tmp_path / "run", progress=False, log=stop_at_the_epoch)
    assert not petfunc_handlers() and logging.getLogger("petfunc").level == logging.NOTSET
    last = (tmp_path / "run" / LOG_NAME).read_text(encoding="utf-8").splitlines()[-2:]
    assert "[INFO] - epoch    1/1" in last[0]
    assert last[1].endswith("[ERROR] - the run stopped: KeyboardInterrupt (interrupted or terminated)")
    # an error before the folder is ready: no file, no handler
    with pytest.raises(ValueError):
        fit(tiny_options(dataset, batch_size=0), tmp_path / "bad", progress=False, log=quiet())
    assert not petfunc_handlers() and not (tmp_path / "bad").exists()


def test_a_run_the_lock_refuses_writes_nothing_into_the_others_log(dataset, tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / LOG_NAME).write_text("the log of the run that holds the folder\n")
    fd = hold_folder(run)
    lines = []
    try:
        with pytest.raises(FolderInUseError, match="pid 4242"):
            fit(tiny_options(dataset, num_epochs=1), run, progress=False, log=quiet(lines))
    finally:
        os.close(fd)
    assert (run / LOG_NAME).read_text() == "the log of the run that holds the folder\n"
    assert not petfunc_handlers()


def test_two_runs_in_two_threads_keep_their_logs_apart(tmp_path):
    turns = [threading.Event() for _ in range(4)]
    consoles = {"a": [], "b": []}

    def run(name, waits, signals):
        with RunLog(consoles[name].append) as run_log:
            say(f"{name}: before the file")
            with run_log.writing(tmp_path / f"{name}.log", [f"{name}: header"]):
                for wait, signal in zip(waits, signals):
                    if wait is not None:
                        turns[wait].wait(10)
                    say(f"{name}: line {signal}")
                    turns[signal].set()

    a = threading.Thread(target=run, args=("a", [None, 1], [0, 2]))
    b = threading.Thread(target=run, args=("b", [0, 2], [1, 3]))
    a.start(), b.start()
    a.join(), b.join()
    for name in "ab":
        assert all(line.startswith(f"{name}:") for line in consoles[name]) and len(consoles[name]) == 3
        text = (tmp_path / f"{name}.log").read_text(encoding="utf-8")
        assert [line.split(" - ", 1)[1] for line in text.splitlines()] == [
            f"{name}: header",
            *consoles[name],
        ]
    assert not petfunc_handlers() and logging.getLogger("petfunc").level == logging.NOTSET


def test_a_log_file_that_cannot_be_written_is_said_once(tmp_path):
    import errno

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    lines = []
    with RunLog(lines.append) as run_log:
        with run_log.writing(tmp_path / LOG_NAME, ["header"]) as file:
            file.stream.close()
            file.stream = Full()
            say("first")
            say("second")
    assert lines[
        0
    ] == f"warning: cannot write {tmp_path / LOG_NAME} ([Errno 28] No space left on device); " + (
        "the log goes on on the console only"
    )
    assert lines[1:] == ["first", "second"]


def test_a_level_set_on_the_petfunc_logger_is_kept(tmp_path):
    logging.getLogger("petfunc").setLevel(logging.WARNING)
    lines = []
    try:
        with RunLog(lines.append) as run_log:
            with run_log.writing(tmp_path / LOG_NAME, ["header"]):
                say("an information")
                say("warning: a warning")
    finally:
        logging.getLogger("petfunc").setLevel(logging.NOTSET)
    assert lines == ["warning: a warning"]
    assert (
        (tmp_path / LOG_NAME)
        .read_text(encoding="utf-8")
        .splitlines()[-1]
        .endswith("[WARNING] - warning: a warning")
    )
