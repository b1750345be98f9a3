"""Telling model files apart by their archive layout (petfunc.io.formats)."""

import io

import torch

from petfunc.io.formats import is_torchscript
from tests.helpers.hostile import disguised_pickle


def _saved(save, obj) -> bytes:
    buffer = io.BytesIO()
    save(obj, buffer)
    return buffer.getvalue()


def test_a_torchscript_archive_is_recognised(tmp_path):
    data = _saved(torch.jit.save, torch.jit.script(torch.nn.Linear(2, 2)))
    assert is_torchscript(data)
    (tmp_path / "model.pt").write_bytes(data)
    assert is_torchscript(tmp_path / "model.pt")


def test_pickles_are_not_torchscript(tmp_path):
    assert not is_torchscript(_saved(torch.save, {"weight": torch.ones(2)}))
    assert not is_torchscript(disguised_pickle(tmp_path / "x.ckpt", tmp_path / "marker"))
    assert not (tmp_path / "marker").exists()
    assert not is_torchscript(b"not a zip")
