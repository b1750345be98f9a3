"""LLPR uncertainties in the ASE calculator (petfunc.ase with ``llpr``): read from
metatrain's LLPR checkpoints, eager and compiled, in a fresh process; the inputs it
refuses."""

import glob
import os

import numpy as np
import pytest
import torch


pytest.importorskip("metatrain")

import ase.build

import petfunc
from petfunc import llpr
from petfunc.ase import PETCalculator
from tests.helpers.mtt_reference import shipped_checkpoints
from tests.helpers.patches import needs_patches


CHECKPOINTS = shipped_checkpoints("llpr")


def _frames():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    cell = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    cell.rattle(0.05, seed=3)
    return [ethanol, cell]


@needs_patches("vmap_rules")
def test_calculator_reads_llpr_checkpoints():
    """PETCalculator.from_metatrain on an LLPR checkpoint: energy_uncertainty is the
    calibrated LLPR value, the ensemble is centred on the model's prediction, and
    the uncertainties are finite and positive; the compiled calculator agrees."""
    path = CHECKPOINTS[-1]
    config, params, uncertainty = llpr.from_metatrain(path, dtype=torch.float64)
    atoms = _frames()[1]
    positions, cell, neighbors = petfunc.from_atoms([atoms], config, dtype=torch.float64)
    _, sigma = llpr.energy_and_uncertainty(config)(params, uncertainty, positions, cell, neighbors)
    results = []
    for compile in (False, True):
        calc = PETCalculator.from_metatrain(path, dtype=torch.float64, compile=compile, backend="aot_eager")
        assert calc.llpr is not None
        atoms.calc = calc
        atoms.get_potential_energy()
        # uncertainty and member energies from the features alone; member forces on demand
        assert "forces_ensemble" not in calc.results and calc.results["energy_ensemble"].shape == (8,)
        cheap = dict(calc.results)
        calc.get_property("forces_uncertainty", atoms)
        r = dict(calc.results)
        for key in ("energy", "energy_uncertainty", "energy_ensemble"):
            np.testing.assert_allclose(r[key], cheap[key], rtol=1e-13)
        assert r["energy_uncertainty"] == pytest.approx(float(sigma[0]), rel=1e-12)
        assert r["energy_ensemble"].shape == (8,) and r["forces_ensemble"].shape == (8, len(atoms), 3)
        assert r["energy_ensemble"].mean() == pytest.approx(r["energy"], rel=1e-12)
        np.testing.assert_allclose(r["forces_ensemble"].mean(axis=0), r["forces"], atol=1e-12)
        assert np.all(r["forces_uncertainty"] > 0) and np.all(np.isfinite(r["stress_uncertainty"]))
        results.append(r)
    for key in ("energy", "energy_uncertainty", "energy_ensemble", "forces_ensemble"):
        np.testing.assert_allclose(results[1][key], results[0][key], rtol=1e-10, atol=1e-12)
    # the compiled LLPR functions serve other sizes without recompiling
    eager = PETCalculator.from_metatrain(path, dtype=torch.float64)
    for other in (_frames()[0], atoms.repeat((2, 1, 1))):
        values = []
        for c in (calc, eager):
            other = other.copy()
            other.calc = c
            values.append(
                (c.get_property("energy_uncertainty", other), c.get_property("forces_uncertainty", other))
            )
        assert values[0][0] == pytest.approx(values[1][0], rel=1e-10)
        np.testing.assert_allclose(values[0][1], values[1][1], rtol=1e-8, atol=1e-12)
    assert {name: c.num_graphs for name, c in calc._llpr._compiled.items()} == {"features": 1, "offsets": 1}


def test_llpr_errors(tmp_path):
    pet = glob.glob(
        os.path.join(
            os.path.dirname(__import__("metatrain.pet", fromlist=["_"]).__file__),
            "tests",
            "checkpoints",
            "model-v16*.ckpt.gz",
        )
    )[0]
    with pytest.raises(ValueError, match="not an LLPR checkpoint.*architecture_name='pet'"):
        llpr.from_metatrain(pet)
    config, params, uncertainty = llpr.from_metatrain(CHECKPOINTS[-1])
    with pytest.raises(ValueError, match="llpr needs params, and excludes ensemble_params"):
        PETCalculator(config, ensemble_params=[params, params], llpr=uncertainty)
    # petfunc export keeps the PET of an LLPR checkpoint, and says the uncertainty stays behind
    from petfunc.io import is_llpr_checkpoint

    assert is_llpr_checkpoint(CHECKPOINTS[-1]) and not is_llpr_checkpoint(pet)
    assert not is_llpr_checkpoint(tmp_path / "missing.ckpt")


def test_fresh_process_reads_llpr_checkpoints():
    """In a new process (metatomic's TorchScript classes not yet registered) both
    readers and the calculator load an LLPR checkpoint."""
    import subprocess
    import sys

    code = (
        "import sys, petfunc\n"
        "from petfunc.ase import PETCalculator\n"
        "config, params, u = petfunc.llpr.from_metatrain(sys.argv[1])\n"
        "calc = PETCalculator.from_metatrain(sys.argv[1])\n"
        "print(sorted(u), calc.llpr is not None)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, CHECKPOINTS[-1]], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "['cholesky', 'ensemble_weights', 'multiplier'] True" in out.stdout
