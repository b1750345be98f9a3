"""The model file a suffix names (petfunc.export.formats): checked before any work."""

import pytest

from petfunc.export import check_model_file, export_model


def test_model_files_by_suffix(tmp_path):
    assert check_model_file(tmp_path / "a.pt2") == tmp_path / "a.pt2"
    with pytest.raises(ValueError, match=r"must end in .pt2 \(petfunc's PT2 archive\) or .pt"):
        check_model_file(tmp_path / "a.onnx")
    (tmp_path / "b.pt2").mkdir()
    with pytest.raises(ValueError, match="is an existing folder"):
        check_model_file(tmp_path / "b.pt2")
    with pytest.raises(NotImplementedError, match=r"cannot write metatomic models \(.pt\)"):
        export_model(None, None, tmp_path / "c.pt")
