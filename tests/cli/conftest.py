"""The demo run the command-line tests evaluate, restart and copy."""

import pytest

from petfunc.cli import main
from tests.helpers.cli import TINY


@pytest.fixture(scope="package")
def demo_run(tmp_path_factory):
    """``petfunc train`` without an options file (built-in dataset), tiny model, 1 epoch."""
    out = tmp_path_factory.mktemp("demo")
    code = main(["train", "--output", str(out), "--structures", "16", "--epochs", "1", *TINY])
    assert code == 0
    return out
