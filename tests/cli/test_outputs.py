"""Where ``petfunc train`` writes (petfunc.cli.outputs): -o as a model file or a run
folder, and the checkpoint of --restart auto."""

import os
import sys
import time

import pytest

from petfunc.cli.outputs import newest_checkpoint, split_output


def test_output_is_a_model_file_or_a_run_folder(tmp_path):
    assert split_output(None) == (None, None)
    assert split_output(str(tmp_path / "runs" / "a")) == (tmp_path / "runs" / "a", None)
    assert split_output(str(tmp_path / "model.pt2")) == (None, tmp_path / "model.pt2")
    # a trailing separator makes any name a folder
    assert split_output(str(tmp_path / "model.pt2") + os.sep) == (tmp_path / "model.pt2", None)
    (tmp_path / "taken.pt2").mkdir()
    with pytest.raises(ValueError, match=r"'.*taken.pt2' is an existing folder.*-o .*taken.pt2/"):
        split_output(str(tmp_path / "taken.pt2"))
    with pytest.raises(ValueError, match="checkpoints are written into the run folder"):
        split_output("last.ckpt")


def test_a_metatomic_model_file_needs_the_extra(tmp_path, monkeypatch):
    pytest.importorskip("metatomic.torch")
    assert split_output(str(tmp_path / "model.pt")) == (None, tmp_path / "model.pt")
    monkeypatch.setitem(sys.modules, "metatomic.torch", None)  # as if not installed
    with pytest.raises(ValueError, match=r"writing metatomic models needs the metatrain extra"):
        split_output("model.pt")


def test_restart_auto_takes_the_newest_run(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint to continue: no DATE/TIME/last.ckpt in"):
        newest_checkpoint(tmp_path / "outputs")
    paths = []
    for folder in ("2025-01-02/10-00-00", "2025-01-01/23-59-59", "2025-01-02/10-00-00.1", "notes/old"):
        path = tmp_path / "outputs" / folder / "last.ckpt"
        path.parent.mkdir(parents=True)
        path.write_bytes(b"x")
        paths.append(path)
    # the newest written, whatever its name; a folder not named DATE/TIME is not a run
    now = time.time()
    for age, path in zip((30, 10, 20, 0), paths):
        os.utime(path, (now - age, now - age))
    assert newest_checkpoint(tmp_path / "outputs") == paths[1]
