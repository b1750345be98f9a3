"""Composition weights and energy scale: fixed by the options, read from metatrain's
composition and scaler checkpoints, fitted (per atom or per structure).
"""

import numpy as np
import pytest
import torch

from petfunc.io import read_checkpoint
from petfunc.trainer import fit
from petfunc.trainer.options import resolve_options
from tests.helpers.trainer import TINY_MODEL, quiet, tiny_options


def test_atomic_baseline_fixes_the_composition(dataset):
    """metatrain's atomic_baseline: a weight per type, or one weight for all types;
    the scale is then fitted on the residual of the fixed weights."""
    baseline = {"energy": {13: -3.5, "28": -5.0, 29: -4.0}}  # YAML/JSON may give string keys
    result = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline=baseline), None, progress=False, log=quiet()
    )
    weights = result.params["composition_weights"]
    assert weights.tolist() == [-3.5, -5.0, -4.0]
    result = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": -2.0}),
        None,
        progress=False,
        log=quiet(),
    )
    assert result.params["composition_weights"].tolist() == [-2.0, -2.0, -2.0]
    with pytest.raises(ValueError, match=r"no weight for atomic type\(s\) \[28\]"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": {13: -3.5, 29: -4.0}}),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(FileNotFoundError, match="no composition checkpoint at"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline="missing.ckpt"),
            None,
            progress=False,
            log=quiet(),
        )


def _mtt_train(tmp_path, name, architecture, dataset, cwd):
    """``mtt train`` (metatrain's command) on ``dataset``; returns its checkpoint."""
    import subprocess
    import sys

    import yaml

    options = {
        "seed": 7,
        "architecture": architecture,
        "validation_set": 0.25,
        "test_set": 0.0,
        "training_set": {"systems": str(dataset), "targets": {"energy": {"key": "energy", "unit": "eV"}}},
    }
    (cwd / f"{name}.yaml").write_text(yaml.safe_dump(options))
    subprocess.run(
        [sys.executable, "-m", "metatrain", "train", f"{name}.yaml", "-o", f"{name}.pt"],
        cwd=cwd,
        check=True,
        capture_output=True,
    )
    return cwd / f"{name}.ckpt"


def test_composition_and_scaler_checkpoints_like_mtt_train(dataset, tmp_path):
    """metatrain's atomic_baseline: composition.ckpt and fixed_scaling_weights:
    scaler.ckpt (checkpoints of mtt train's composition and scaler architectures):
    the composition and scale petfunc trains with equal those mtt train's PET gets."""
    pytest.importorskip("metatrain")
    import petfunc

    composition = _mtt_train(tmp_path, "composition", {"name": "composition"}, dataset, tmp_path)
    scaler = _mtt_train(
        tmp_path,
        "scaler",
        {"name": "scaler", "training": {"additive_models": [str(composition)]}},
        dataset,
        tmp_path,
    )
    model = dict(TINY_MODEL)
    training = {
        "num_epochs": 1,
        "batch_size": 4,
        "atomic_baseline": str(composition),
        "fixed_scaling_weights": str(scaler),
    }
    reference = _mtt_train(
        tmp_path, "pet", {"name": "pet", "model": model, "training": training}, dataset, tmp_path
    )
    _, expected = petfunc.from_metatrain(reference)

    options = tiny_options(dataset, **{**training, "num_epochs": 0})
    result = fit(options, None, progress=False, log=quiet())
    assert torch.equal(result.params["composition_weights"], expected["composition_weights"])
    assert float(result.params["energy_scale"]) == float(expected["energy_scale"])
    own = fit(tiny_options(dataset, num_epochs=0), None, progress=False, log=quiet()).params  # another split
    assert not torch.equal(own["composition_weights"], expected["composition_weights"])
    assert float(own["energy_scale"]) != float(expected["energy_scale"])

    # the composition alone: the scale is fitted on its residual, as with fixed weights
    fixed = {int(z): float(w) for z, w in zip(result.config.atomic_types, expected["composition_weights"])}
    alone = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline=str(composition)),
        None,
        progress=False,
        log=quiet(),
    ).params
    by_value = fit(
        tiny_options(dataset, num_epochs=0, atomic_baseline={"energy": fixed}),
        None,
        progress=False,
        log=quiet(),
    ).params
    assert float(alone["energy_scale"]) == float(by_value["energy_scale"])

    # metatrain's checks, with petfunc's messages
    unscaled = _mtt_train(tmp_path, "plain_scaler", {"name": "scaler"}, dataset, tmp_path)
    with pytest.raises(ValueError, match=r"fitted after subtracting the additive models \[\]"):
        fit(
            tiny_options(
                dataset, num_epochs=0, atomic_baseline=str(composition), fixed_scaling_weights=str(unscaled)
            ),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(ValueError, match="holds a Scaler, not a metatrain CompositionModel"):
        fit(
            tiny_options(dataset, num_epochs=0, atomic_baseline=str(scaler)),
            None,
            progress=False,
            log=quiet(),
        )
    with pytest.raises(ValueError, match="fitted on energies in 'eV', the training data are in 'Hartree'"):
        hartree = tiny_options(dataset, num_epochs=0, atomic_baseline=str(composition))
        hartree["training_set"] = {"systems": str(dataset), "targets": {"energy": {"unit": "Hartree"}}}
        fit(hartree, None, progress=False, log=quiet())
    with pytest.raises(
        ValueError, match="needs 'architecture.training.atomic_baseline' to name a composition"
    ):
        resolve_options(
            {"training_set": "x.xyz", "architecture": {"training": {"fixed_scaling_weights": "s.ckpt"}}}
        )


def test_fixed_scaling_weights(dataset):
    """metatrain's fixed_scaling_weights: {energy: c} replaces the fitted scale, the
    composition is still fitted, and scale_targets: false wins (scale 1)."""
    fitted = fit(tiny_options(dataset, num_epochs=0), None, progress=False, log=quiet()).params
    result = fit(
        tiny_options(dataset, num_epochs=0, fixed_scaling_weights={"energy": 0.25}),
        None,
        progress=False,
        log=quiet(),
    )
    assert float(result.params["energy_scale"]) == 0.25 != float(fitted["energy_scale"])
    assert torch.equal(result.params["composition_weights"], fitted["composition_weights"])
    result = fit(
        tiny_options(dataset, num_epochs=0, fixed_scaling_weights={"energy": 0.25}, scale_targets=False),
        None,
        progress=False,
        log=quiet(),
    )
    assert float(result.params["energy_scale"]) == 1.0
    for bad, message in (
        ({"energy": {13: 1.0}}, "per-structure energy target"),
        ({"energy": 0.0}, "positive"),
        ({"forces": 1.0}, "forces"),
    ):
        with pytest.raises(ValueError, match=message):
            resolve_options(
                {"training_set": "x.xyz", "architecture": {"training": {"fixed_scaling_weights": bad}}}
            )


def test_energy_scale_of_a_composition_that_fits_exactly():
    """As many structures as species: the composition reproduces the energies to
    round-off, and a scale of that round-off (1e-15 eV) made the loss 1e30. The
    scale is then 1 eV, with a warning; a real residual is kept."""
    import ase.build
    from ase.calculators.emt import EMT

    from petfunc import PETConfig
    from petfunc.data import fit_composition, fit_scale, sample_from_atoms

    config = PETConfig(atomic_types=(13, 29), **TINY_MODEL)
    frames = []
    for n_al in (0, 1, 2):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True)
        atoms.numbers[:n_al] = 13
        atoms.rattle(0.05, seed=n_al)
        atoms.calc = EMT()
        atoms.get_potential_energy()
        frames.append(atoms)
    samples = [sample_from_atoms(a, config) for a in frames]
    w = fit_composition(samples[:2], config.num_species)
    with pytest.warns(UserWarning, match="reproduce the 2 training energies to round-off"):
        assert fit_scale(samples[:2], w) == 1.0
    w = fit_composition(samples, config.num_species)
    residual = [(s.energy - w[s.structure.species].sum()) / len(s) for s in samples]
    assert fit_scale(samples, w) == pytest.approx(np.sqrt(np.mean(np.square(residual))), rel=1e-14)
    assert 1e-6 < fit_scale(samples, w) < 1.0


def test_per_structure_targets(dataset, tmp_path):
    """``per_structure_targets: [energy]``: the scale is the RMS of the per-structure
    residual and the logged validation energy RMSE is per structure: it equals one
    computed here with the calculator (eV, float64)."""
    import ase.io

    from petfunc.ase.calculator import PETCalculator
    from petfunc.data import fit_scale, sample_from_atoms

    options = tiny_options(dataset, num_epochs=1, per_structure_targets=["energy"])
    options["base_precision"] = 64
    lines = []
    result = fit(options, tmp_path / "run", progress=False, log=quiet(lines))
    assert any("energy per structure (eV)" in line for line in lines), lines
    split = read_checkpoint(tmp_path / "run" / "last.ckpt")["split"]
    frames = ase.io.read(dataset, ":")
    config = result.config
    train = [sample_from_atoms(frames[i], config) for i in split["training"][0]]
    composition = result.last_params["composition_weights"].numpy()
    scale = float(result.last_params["energy_scale"])
    assert scale == pytest.approx(fit_scale(train, composition, per_atom=False), rel=1e-14)
    assert abs(scale / fit_scale(train, composition) - 1) > 0.5
    calc = PETCalculator(config, result.last_params)
    errors = []
    for i in split["validation"][0]:
        atoms = frames[i].copy()
        reference = frames[i].get_potential_energy()
        atoms.calc = calc
        errors.append(atoms.get_potential_energy() - reference)
    expected = float(np.sqrt(np.mean(np.square(errors))))
    assert result.history[-1]["val_energy_rmse"] == pytest.approx(expected, rel=1e-9)
    with pytest.raises(ValueError, match=r"per_structure_targets': unknown target\(s\) \['forces'\]"):
        fit(tiny_options(dataset, per_structure_targets=["forces"]), None, progress=False, log=quiet())
