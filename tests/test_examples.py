"""Every example runs to the end in smoke mode (``PETFUNC_SMOKE=1``: tiny data and
models, seconds each). Append new examples to ``EXAMPLES``."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = [
    "train_functional.py",
    "ensemble_uncertainty.py",
    "vibrations.py",
    "md.py",
]


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_runs(name, tmp_path):
    env = {**os.environ, "PETFUNC_SMOKE": "1", "OMP_NUM_THREADS": "1", "MPLBACKEND": "Agg"}
    result = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name)],
        cwd=tmp_path,  # examples write their outputs (plots) to the working directory
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"{name} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
