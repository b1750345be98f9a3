"""The dependency floors of pyproject.toml exclude the releases known to be wrong for
petfunc, and the optional extras name what the optional features import."""

from importlib.metadata import version
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]


def project():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def release(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def test_vesin_floor_excludes_the_releases_that_miss_pairs():
    """vesin below 0.5.8 misses pairs in rotated and partly periodic cells."""
    (vesin,) = [d for d in project()["dependencies"] if d.startswith("vesin")]
    assert vesin == "vesin>=0.5.8"
    assert release(version("vesin")) >= (0, 5, 8)


def test_wandb_is_an_extra():
    assert [d for d in project()["optional-dependencies"]["wandb"] if d.startswith("wandb")]
