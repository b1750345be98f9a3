"""The record of the artifacts this machine exported (petfunc.export.trust)."""

import pytest

from petfunc.export import trust


def test_a_recorded_file_is_trusted_byte_for_byte(tmp_path, monkeypatch):
    monkeypatch.setenv("PETFUNC_CACHE_DIR", str(tmp_path / "cache"))
    artifact = tmp_path / "model.pt2"
    artifact.write_bytes(b"library and program")
    assert not trust.recorded(artifact)
    trust.record(artifact)
    assert trust.recorded(artifact)
    assert (tmp_path / "cache" / "exports" / trust.digest(artifact)).is_file()
    artifact.write_bytes(b"library and program, changed")
    assert not trust.recorded(artifact)


def test_the_record_folder(tmp_path, monkeypatch):
    monkeypatch.delenv("PETFUNC_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert trust.exports_folder() == tmp_path / "xdg" / "petfunc" / "exports"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert trust.exports_folder() == tmp_path / "home" / ".cache" / "petfunc" / "exports"


def test_an_unwritable_record_warns(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("PETFUNC_CACHE_DIR", str(tmp_path / "file"))  # a file, not a folder
    artifact = tmp_path / "model.pt2"
    artifact.write_bytes(b"x")
    with pytest.warns(UserWarning, match="could not be recorded.*aoti=True"):
        trust.record(artifact)
    assert not trust.recorded(artifact)
