"""The README's quick example runs and its commands are the ones CI uses."""

import re
from pathlib import Path


README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_python_blocks_run():
    text = README.read_text()
    blocks = re.findall(r"<!-- executed by tests/docs/test_readme.py -->\n```python\n(.*?)```", text, re.S)
    assert blocks, "no executable block found in README.md"
    for block in blocks:
        exec(compile(block, "README.md", "exec"), {})


def test_ci_runs_the_readme_test_command():
    text = README.read_text()
    ci = (README.parent / ".ci" / "run").read_text()
    command = 'python -m pytest -m "not slow"'
    assert command in text and command in ci
