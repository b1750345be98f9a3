"""Every example runs to the end in smoke mode (``PETFUNC_SMOKE=1``: tiny data and
models, seconds each), and the MD example's ``--smoke`` run writes its trajectory.
Append new examples to ``EXAMPLES``."""

import os
import subprocess
import sys
from pathlib import Path

import ase.io
import pytest

from tests.helpers.patches import needs_patches


ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = [
    "train_functional.py",
    "ensemble_uncertainty.py",
    pytest.param("vibrations.py", marks=needs_patches("layer_norm_decomposition")),
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


@pytest.mark.slow
def test_md_example_smoke(tmp_path):
    script = ROOT / "examples" / "md.py"
    output = tmp_path / "md.extxyz"
    result = subprocess.run(
        [sys.executable, str(script), "--smoke", "--output", str(output)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "RANDOM parameters" in result.stdout
    frames = ase.io.read(output, index=":")
    assert len(frames) == 5 and "forces" in frames[-1].calc.results
