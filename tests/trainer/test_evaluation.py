"""Predictions and their errors."""

import math

import numpy as np
import pytest


def test_error_metrics_skip_missing_labels_not_nan_predictions():

    from petfunc.trainer import error_metrics

    pred = {
        "energy_per_atom": [1.0, 2.0, np.nan],
        "energy_per_atom_ref": [1.5, np.nan, 3.0],
        "forces": [[0.0, 1.0, 2.0]],
        "forces_ref": [[1.0, np.nan, 0.0]],
        "stress": [],
        "stress_ref": [],
    }
    out = error_metrics(pred)
    assert math.isnan(out["energy_per_atom_rmse"]) and out["energy_per_atom_count"] == 2
    assert out["energy_per_atom_nan_predictions"] == 1
    assert out["forces_rmse"] == pytest.approx(math.sqrt(2.5)) and out["forces_count"] == 2
    assert "forces_nan_predictions" not in out and "stress_rmse" not in out
