"""``petfunc eval``: errors, predictions written in the file's units, virials, the
labels a model was trained on, bad input.
"""

import json

import pytest

from petfunc.cli import main
from petfunc.trainer import evaluate
from tests.helpers.cli import TINY


def test_eval(demo_run, capsys):
    capsys.readouterr()
    code = main(
        [
            "eval",
            str(demo_run / "best.ckpt"),
            str(demo_run / "dataset.xyz"),
            "--json",
            str(demo_run / "m.json"),
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "16 structures" in out
    for name in ("energy/atom", "forces", "stress", "eV/atom", "RMSE", "MAE"):
        assert name in out, out
    metrics = json.loads((demo_run / "m.json").read_text())
    assert metrics["forces_count"] == 3 * metrics["n_atoms"] and metrics["energy_per_atom_rmse"] > 0


def test_eval_writes_predictions(demo_run, tmp_path, capsys):
    """``petfunc eval --output``: one frame per structure with the predicted energy,
    forces and (periodic cells only) stress, equal to the calculator's."""
    import ase.build
    import ase.io
    import numpy as np

    from petfunc.ase.calculator import PETCalculator
    from petfunc.io import load_model

    frames = ase.io.read(demo_run / "dataset.xyz", ":3")
    molecule = ase.Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    dataset = tmp_path / "mixed.xyz"
    ase.io.write(dataset, frames + [molecule])
    out = tmp_path / "predictions.xyz"
    assert main(["eval", str(demo_run / "best.ckpt"), str(dataset), "-o", str(out)]) == 0
    assert f"predictions written to {out}" in capsys.readouterr().out
    predicted = ase.io.read(out, ":")
    assert len(predicted) == 4
    config, params = load_model(demo_run / "best.ckpt")
    for atoms, reference in zip(predicted, frames + [molecule]):
        np.testing.assert_array_equal(atoms.numbers, reference.numbers)
        np.testing.assert_allclose(atoms.positions, reference.positions, atol=1e-8)
        reference = reference.copy()
        reference.calc = PETCalculator(config, params)
        assert atoms.get_potential_energy() == pytest.approx(reference.get_potential_energy(), rel=1e-5)
        np.testing.assert_allclose(atoms.get_forces(), reference.get_forces(), rtol=1e-4, atol=1e-5)
        if reference.pbc.all():
            np.testing.assert_allclose(atoms.get_stress(), reference.get_stress(), rtol=1e-4, atol=1e-6)
    assert "stress" not in predicted[3].calc.results
    # a file without labels: predictions only (as mtt eval without targets)
    bare = tmp_path / "bare.xyz"
    ase.io.write(bare, [atoms.copy() for atoms in frames])
    assert main(["eval", str(demo_run / "best.ckpt"), str(bare)]) == 2
    assert "has no labels" in capsys.readouterr().err
    assert main(["eval", str(demo_run / "best.ckpt"), str(bare), "-o", str(tmp_path / "bare_out.xyz")]) == 0
    assert "no labels in the file: predictions only" in capsys.readouterr().out
    bare_predicted = ase.io.read(tmp_path / "bare_out.xyz", ":")
    for atoms, reference in zip(bare_predicted, predicted):
        assert atoms.get_potential_energy() == reference.get_potential_energy()
    # a file read in kcal/mol and bohr gets its predictions in those units
    from ase.units import Bohr, kcal, mol

    scaled = []
    for atoms in frames:
        atoms = atoms.copy()
        atoms.set_cell(atoms.cell / Bohr, scale_atoms=True)
        scaled.append(atoms)
    ase.io.write(tmp_path / "bohr.xyz", scaled)
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(tmp_path / "bohr.xyz"),
                "-o",
                str(tmp_path / "bohr_out.xyz"),
                "--energy-unit",
                "kcal/mol",
                "--length-unit",
                "bohr",
            ]
        )
        == 0
    )
    for atoms, reference, original in zip(ase.io.read(tmp_path / "bohr_out.xyz", ":"), predicted, scaled):
        np.testing.assert_allclose(atoms.positions, original.positions, atol=1e-7)
        assert atoms.get_potential_energy() == pytest.approx(
            reference.get_potential_energy() * mol / kcal, rel=1e-6
        )
        np.testing.assert_allclose(
            atoms.get_forces(), reference.get_forces() * Bohr * mol / kcal, rtol=1e-4, atol=1e-5
        )
        np.testing.assert_allclose(
            atoms.get_stress(), reference.get_stress() * Bohr**3 * mol / kcal, rtol=1e-4, atol=1e-6
        )


def test_eval_reads_virials(demo_run, tmp_path, capsys):
    """``--virial-key``: virial labels W are compared as the stress -W/V, so a file of
    virials gives the stress errors of the same file with stresses."""
    import ase.io
    import numpy as np
    from ase.stress import voigt_6_to_full_3x3_stress

    frames = ase.io.read(demo_run / "dataset.xyz", ":4")
    with_virials = []
    for atoms in frames:
        copy = atoms.copy()
        copy.info["energy"] = atoms.get_potential_energy()
        copy.arrays["forces"] = atoms.get_forces()
        copy.info["virial"] = -voigt_6_to_full_3x3_stress(atoms.get_stress()) * atoms.get_volume()
        with_virials.append(copy)
    ase.io.write(tmp_path / "virials.xyz", with_virials)
    json_s, json_w = tmp_path / "s.json", tmp_path / "w.json"
    ase.io.write(tmp_path / "stresses.xyz", frames)
    assert (
        main(["eval", str(demo_run / "best.ckpt"), str(tmp_path / "stresses.xyz"), "--json", str(json_s)])
        == 0
    )
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(tmp_path / "virials.xyz"),
                "--virial-key",
                "virial",
                "--json",
                str(json_w),
            ]
        )
        == 0
    )
    stress, virial = json.loads(json_s.read_text()), json.loads(json_w.read_text())
    assert virial["stress_count"] == stress["stress_count"] == 4 * 9
    np.testing.assert_allclose(virial["stress_rmse"], stress["stress_rmse"], rtol=1e-6)


def test_eval_reads_labels_as_the_model_was_trained(demo_run, tmp_path, capsys):
    """A model trained on other keys and units is evaluated on them by default."""
    import ase.io
    import ase.units

    frames = ase.io.read(demo_run / "dataset.xyz", ":12")
    renamed = []
    for atoms in frames:
        copy = atoms.copy()
        copy.info["U0"] = atoms.get_potential_energy() / (ase.units.kcal / ase.units.mol)
        copy.arrays["F"] = atoms.get_forces() / (ase.units.kcal / ase.units.mol)
        renamed.append(copy)
    ase.io.write(tmp_path / "kcal.xyz", renamed)
    options = tmp_path / "options.yaml"
    options.write_text(
        f"training_set:\n  systems: {tmp_path / 'kcal.xyz'}\n  targets:\n    energy:\n      key: U0\n"
        "      unit: kcal/mol\n      forces: {key: F}\n      stress: false\nvalidation_set: 0.25\n"
    )
    assert main(["train", str(options), "--output", str(tmp_path / "run"), "--epochs", "1", *TINY]) == 0
    capsys.readouterr()
    model = str(tmp_path / "run" / "best.ckpt")
    assert main(["eval", model, str(tmp_path / "kcal.xyz"), "--json", str(tmp_path / "a.json")]) == 0
    assert (
        "labels read as the model was trained: energy key 'U0', forces key 'F', energy unit 'kcal/mol'"
        in capsys.readouterr().out
    )
    ase.io.write(tmp_path / "ev.xyz", frames)
    assert (
        main(
            [
                "eval",
                model,
                str(tmp_path / "ev.xyz"),
                "--energy-key",
                "energy",
                "--forces-key",
                "forces",
                "--energy-unit",
                "eV",
                "--json",
                str(tmp_path / "b.json"),
            ]
        )
        == 0
    )
    a, b = json.loads((tmp_path / "a.json").read_text()), json.loads((tmp_path / "b.json").read_text())
    assert a["forces_count"] == b["forces_count"] > 0 and "stress_rmse" not in a
    for key in ("energy_per_atom_rmse", "forces_rmse", "forces_mae"):
        assert a[key] == pytest.approx(b[key], rel=1e-6)


def test_eval_errors(demo_run, tmp_path, capsys):
    assert main(["eval", str(demo_run / "best.ckpt"), str(tmp_path / "missing.xyz")]) == 2
    assert "not found" in capsys.readouterr().err
    garbage = tmp_path / "garbage.xyz"
    garbage.write_text("this is not\nan xyz file\n")
    assert main(["eval", str(demo_run / "best.ckpt"), str(garbage)]) == 2
    assert "could not read dataset file" in capsys.readouterr().err
    assert main(["eval", str(garbage), str(demo_run / "dataset.xyz")]) == 2
    assert "error" in capsys.readouterr().err
    # a checkpoint cut short (an interrupted copy): the archive's own reason, not metatrain's
    data = (demo_run / "best.ckpt").read_bytes()
    (tmp_path / "cut.ckpt").write_bytes(data[: len(data) // 2])
    assert main(["eval", str(tmp_path / "cut.ckpt"), str(demo_run / "dataset.xyz")]) == 2
    assert (
        "cut.ckpt' is not a readable petfunc or metatrain model file, damaged or truncated?"
        in capsys.readouterr().err
    )
    # a label key given on the command line but in no structure (a typo): an error, not
    # a table without its energy row
    assert (
        main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz"), "--energy-key", "E"]) == 2
    )
    assert "no structure has labels under the key(s) ['E'] (keys in the file:" in capsys.readouterr().err
    assert (
        main(
            [
                "eval",
                str(demo_run / "best.ckpt"),
                str(demo_run / "dataset.xyz"),
                "--stress-key",
                "stress",
                "--virial-key",
                "virial",
            ]
        )
        == 2
    )
    assert "give --stress-key or --virial-key, not both" in capsys.readouterr().err
    # a negative batch size read no structure and exited 0 ("no labels in the file")
    with pytest.raises(SystemExit) as exit_info:
        main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz"), "--batch-size", "-3"])
    assert exit_info.value.code == 2
    assert "argument --batch-size: expected a positive integer, got -3" in capsys.readouterr().err
    with pytest.raises(ValueError, match="batch_size must be a positive integer, got 0"):
        evaluate(demo_run / "best.ckpt", demo_run / "dataset.xyz", batch_size=0)


def test_eval_reads_a_metatrain_dataset_file(demo_run, tmp_path, capsys):
    """``mtt eval MODEL options.yaml``'s dataset section (keys, units, a list of
    datasets) and ``-b``: the errors of the extxyz file read with the same labels."""
    import yaml

    data = str(demo_run / "dataset.xyz")
    assert main(["eval", str(demo_run / "best.ckpt"), data, "--json", str(tmp_path / "plain.json")]) == 0
    plain = json.loads((tmp_path / "plain.json").read_text())
    section = {
        "systems": {"read_from": data, "length_unit": "angstrom"},
        "targets": {"energy": {"key": "energy", "unit": "eV", "forces": {"key": "forces"}, "stress": True}},
    }
    one = tmp_path / "eval.yaml"
    one.write_text(yaml.safe_dump(section))
    model = str(demo_run / "best.ckpt")
    assert main(["eval", model, str(one), "-b", "3", "--json", str(tmp_path / "m.json")]) == 0
    metrics = json.loads((tmp_path / "m.json").read_text())
    for key in ("energy_per_atom_rmse", "forces_mae", "stress_rmse"):
        assert metrics[key] == pytest.approx(plain[key], rel=1e-5)
    # a list: one predictions file per dataset, named as mtt eval names them; the
    # second in meV with no forces read
    milli = {"systems": data, "targets": {"energy": {"unit": "meV", "forces": False}}}
    several = tmp_path / "several.yml"
    several.write_text(yaml.safe_dump([section, milli]))
    capsys.readouterr()
    assert main(["eval", model, str(several), "-o", str(tmp_path / "p.xyz")]) == 0
    out = capsys.readouterr().out
    assert (tmp_path / "p_0.xyz").is_file() and (tmp_path / "p_1.xyz").is_file()
    second = out.split("predictions written to")[1]
    assert "forces" in out.split("predictions written to")[0] and "forces" not in second.split("\n", 1)[1]


def test_eval_dataset_file_errors(demo_run, tmp_path, capsys):
    import yaml

    model = str(demo_run / "best.ckpt")
    path = tmp_path / "eval.yaml"
    path.write_text(yaml.safe_dump({"systems": str(demo_run / "dataset.xyz")}))
    assert main(["eval", model, str(path), "--energy-key", "U0"]) == 2
    assert "--energy-key: the labels of the dataset file" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"systems": str(demo_run / "dataset.xyz"), "indices": [0, 1]}))
    assert main(["eval", model, str(path)]) == 2
    assert "indices': petfunc eval evaluates every structure" in capsys.readouterr().err
    path.write_text(
        yaml.safe_dump({"systems": str(demo_run / "dataset.xyz"), "targets": {"energy": {"key": "U0"}}})
    )
    assert main(["eval", model, str(path)]) == 2
    assert "no structure has labels under the key(s) ['U0']" in capsys.readouterr().err
    path.write_text(yaml.safe_dump({"system": "x.xyz"}))
    assert main(["eval", model, str(path)]) == 2
    assert "unknown option" in capsys.readouterr().err


def test_eval_lines_go_through_the_petfunc_logger(demo_run, capsys, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="petfunc")
    capsys.readouterr()
    assert main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [r.getMessage() for r in caplog.records if r.name == "petfunc.cli.eval"] == out
    assert out[0].endswith("dataset.xyz: 16 structures, " + out[0].split(", ")[-1])


def test_eval_out_of_memory_is_one_line(demo_run, capsys, monkeypatch):
    from petfunc.trainer import evaluation
    from tests.helpers.runlog import cuda_out_of_memory

    def derivatives(energy, mode):
        def fails(*args):
            raise cuda_out_of_memory()

        return fails

    monkeypatch.setattr(evaluation, "energy_forces_strain_derivative", derivatives)
    capsys.readouterr()
    assert (
        main(["eval", str(demo_run / "best.ckpt"), str(demo_run / "dataset.xyz"), "--batch-size", "8"]) == 1
    )
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(
        "petfunc: out of memory on the CPU in the evaluation of structures 1..8 of 16 (8 structures, "
    )
    assert "it asked for 2.00 GiB more): evaluate fewer structures at a time (--batch-size)" in err
