"""The content digest of petfunc's files (petfunc.io.digest): it covers every tensor's
bytes, dtype, shape and place and every plain value, not the order a dict was built
in; check_digest names the file it finds altered and passes files without one."""

import math

import pytest
import torch

from petfunc.io.digest import (
    DIGEST_KEY,
    DamagedFileError,
    check_digest,
    has_digest,
    payload_digest,
    with_digest,
)


def _payload():
    return {
        "format": "petfunc.params",
        "version": 1,
        "params": {"a.weight": torch.arange(6.0).reshape(2, 3), "b": torch.tensor(0.5, dtype=torch.float64)},
        "opt": [{"__namedtuple__": "ScaleByAdamState", "mu": torch.zeros(3)}, (1, 2.5, None, True)],
        "rng": torch.arange(10, dtype=torch.uint8),
        "empty": torch.zeros(0, 4),
        "flags": torch.tensor([True, False]),
        "half": torch.ones(3, dtype=torch.bfloat16),
        "scale": 0.42,
        "name": "Cu\u00e9",
        "raw": b"\x00\x01",
    }


def test_digest_is_a_sha256_of_the_content_not_of_the_dict_order():
    payload = _payload()
    digest = payload_digest(payload)
    assert digest.startswith("sha256:") and len(digest) == len("sha256:") + 64
    assert payload_digest(dict(reversed(list(payload.items())))) == digest
    assert payload_digest(with_digest(payload)) == digest  # the digest key is not hashed
    # views, non-contiguous copies and clones of the same values hash alike
    transposed = torch.arange(6.0).reshape(2, 3).T.contiguous().T
    assert not transposed.is_contiguous()
    twisted = dict(payload, params=dict(payload["params"], **{"a.weight": transposed}))
    assert payload_digest(twisted) == digest


@pytest.mark.parametrize(
    "change",
    [
        lambda p: (
            p["params"]["a.weight"].view(-1).view(torch.int32)[4].bitwise_xor_(1)
        ),  # one bit of one element
        lambda p: p["params"].__setitem__("a.weight", p["params"]["a.weight"].reshape(3, 2)),  # shape
        lambda p: p["params"].__setitem__("a.weight", p["params"]["a.weight"].double()),  # dtype
        lambda p: p["params"].__setitem__("a.weigh", p["params"].pop("a.weight")),  # name
        lambda p: p.__setitem__("rng", p["rng"].clone().index_fill_(0, torch.tensor([9]), 11)),
        lambda p: p.__setitem__("scale", math.nextafter(0.42, 1.0)),  # the last bit of a float
        lambda p: p.__setitem__("version", 2),
        lambda p: p.__setitem__("version", 1.0),  # another type, equal value
        lambda p: p.__setitem__("version", True),
        lambda p: p["opt"].__setitem__(1, [1, 2.5, None, True]),  # a list for a tuple
        lambda p: p.__setitem__("name", "Cu"),
        lambda p: p.__setitem__("raw", b"\x00\x02"),
        lambda p: p.__setitem__("extra", None),
        lambda p: p.pop("empty"),
    ],
)
def test_any_change_changes_the_digest(change):
    payload = _payload()
    before = payload_digest(payload)
    change(payload)
    assert payload_digest(payload) != before


def test_check_digest_names_the_altered_file_and_passes_old_files(tmp_path):
    path = tmp_path / "model.pt"
    stored = with_digest(_payload())
    assert has_digest(stored) and not has_digest(_payload()) and not has_digest([1])
    check_digest(stored, path)  # intact
    check_digest(_payload(), path)  # written before petfunc stored a digest: not checked
    stored["params"]["b"].fill_(1.8e306)
    with pytest.raises(DamagedFileError, match=r"'.*model.pt' is damaged: its content does not match"):
        check_digest(stored, path)
    assert issubclass(DamagedFileError, ValueError)
    # a damaged digest string, or a value a digest cannot cover, is damage too
    for bad in ("sha256:0", 12, None):
        with pytest.raises(DamagedFileError, match="model.pt"):
            check_digest(dict(with_digest(_payload()), **{DIGEST_KEY: bad}), path)
    with pytest.raises(DamagedFileError, match="model.pt"):
        check_digest(dict(stored, odd=object()), path)


def test_values_a_digest_cannot_cover_are_refused_when_writing():
    with pytest.raises(TypeError, match="/odd: cannot digest a value of type object"):
        payload_digest({"odd": object()})
    with pytest.raises(TypeError, match="cannot digest a torch.sparse_coo tensor"):
        payload_digest({"sparse": torch.eye(2).to_sparse()})
