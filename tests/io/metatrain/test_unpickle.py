"""Unpickling metatrain checkpoints safely (petfunc.io.metatrain.unpickle): no pickled
code runs, other objects are refused by name unless trusted, a damaged pickle is
named as unreadable."""

import gzip
import io
import zipfile

import pytest
import torch

import petfunc
from tests.helpers.io_setup import assert_same_params, metatrain_checkpoint, metatrain_reference


def _saved_with(tmp_path, extra):
    """A shipped metatrain checkpoint with ``extra`` stored under a new key, saved."""
    with gzip.open(metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False)
    checkpoint["extra"] = extra
    torch.save(checkpoint, tmp_path / "model.ckpt")
    return tmp_path / "model.ckpt"


class _RunsCode:
    """Unpickling this calls ``exec``: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_from_metatrain_runs_no_pickled_code(tmp_path, monkeypatch):
    """Checkpoints load with weights_only=True and metatrain's own objects allowed:
    every shipped one loads so (the parity tests), a file with any other object is
    refused with its name and no code runs, and PETFUNC_TRUST_CHECKPOINTS=1 opts in."""
    metatrain_reference()
    import fractions

    monkeypatch.delenv("PETFUNC_TRUST_CHECKPOINTS", raising=False)
    marker = tmp_path / "ran"
    path = _saved_with(tmp_path, _RunsCode(marker))
    with pytest.raises(
        ValueError, match=r"model.ckpt' holds pickled objects .*builtins.exec.*PETFUNC_TRUST_CHECKPOINTS=1"
    ):
        petfunc.from_metatrain(path)
    with pytest.raises(ValueError, match="builtins.exec"):
        petfunc.load_model(path)
    assert not marker.exists()

    path = _saved_with(tmp_path, fractions.Fraction(1, 3))
    with pytest.raises(ValueError, match=r"\(fractions.Fraction\)"):
        petfunc.from_metatrain(path)
    monkeypatch.setenv("PETFUNC_TRUST_CHECKPOINTS", "1")
    config, params = petfunc.from_metatrain(path)
    config_ref, params_ref = petfunc.from_metatrain(metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz"))
    assert config == config_ref
    assert_same_params(params, params_ref)


def test_from_metatrain_damaged_pickle(tmp_path):
    metatrain_reference()
    with gzip.open(metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        data = handle.read()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        files = {name: archive.read(name) for name in names}
    pkl = next(name for name in names if name.endswith("data.pkl"))
    files[pkl] = files[pkl][: len(files[pkl]) // 2]  # a pickle cut short
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            archive.writestr(name, files[name])
    (tmp_path / "cut.ckpt").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match="'.*cut.ckpt' is not a readable metatrain checkpoint"):
        petfunc.from_metatrain(tmp_path / "cut.ckpt")
