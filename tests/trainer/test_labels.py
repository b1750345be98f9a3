"""Label keys and units: missing labels reported or refused, bad labels named, data
in other length units announced.
"""

import numpy as np
import pytest

from petfunc.trainer import fit
from tests.helpers.trainer import quiet, tiny_options


def test_missing_auto_labels_are_reported(dataset, tmp_path):
    """Forces stored under another key than the one looked for: training goes on with
    energies only, and says so (as metatrain's "No forces found")."""
    import ase.io

    frames = ase.io.read(dataset, ":")
    for atoms in frames:
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = None
        atoms.info["energy"] = energy
        atoms.arrays["dft_forces"] = forces
    ase.io.write(tmp_path / "renamed.xyz", frames)
    lines = []
    result = fit(tiny_options(tmp_path / "renamed.xyz", num_epochs=1), None, progress=False, log=quiet(lines))
    assert (
        "no forces labels in the training files (looked for 'forces'): training without the forces term"
        in lines
    )
    assert any(line.startswith("no stress labels") for line in lines)
    assert "train_forces_rmse" not in result.history[0]


def test_label_errors(dataset, tmp_path):
    # Forces asked for explicitly, under a key the file does not have.
    options = tiny_options(dataset)
    options["training_set"] = {
        "systems": str(dataset),
        "targets": {"energy": {"forces": {"key": "dft_forces"}}},
    }
    with pytest.raises(ValueError, match="dft_forces.*keys in the file"):
        fit(options, None, progress=False, log=quiet())
    # A forces weight in the loss with forces switched off in the data.
    options = tiny_options(dataset, loss={"energy": {"gradients": {"positions": {"weight": 10.0}}}})
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"forces": "auto"}}}
    energy_only = tmp_path / "energy_only.xyz"
    import ase.io

    frames = ase.io.read(dataset, ":")
    for atoms in frames:
        atoms.calc = type(atoms.calc)(atoms, energy=atoms.get_potential_energy())
    ase.io.write(energy_only, frames)
    options["training_set"]["systems"] = str(energy_only)
    with pytest.raises(ValueError, match="loss has a forces term"):
        fit(options, None, progress=False, log=quiet())
    # Wrong energy key.
    options = tiny_options(dataset)
    options["training_set"] = {"systems": str(dataset), "targets": {"energy": {"key": "U0"}}}
    with pytest.raises(ValueError, match="'U0'"):
        fit(options, None, progress=False, log=quiet())
    # An energy of the wrong shape (a 3-vector under the key): named with the key
    # (was numpy's "cannot reshape array of size 3 into shape ()")
    frames = ase.io.read(dataset, ":")
    frames[2].calc.results["energy"] = np.array([1.0, 2.0, 3.0])
    bad = tmp_path / "vector.xyz"
    ase.io.write(bad, frames)
    with pytest.raises(
        ValueError,
        match=r"structure 2: the energy under the key 'energy' has shape \(3,\), "
        r"expected \(\) or \(1,\)",
    ):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    # Infinite labels.
    frames = ase.io.read(dataset, ":")
    frames[0].calc.results["energy"] = float("inf")
    bad = tmp_path / "inf.xyz"
    ase.io.write(bad, frames)
    with pytest.raises(ValueError, match="structure 0: the energy label is infinite"):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    # A stress label on a molecule (no cell volume): named before training starts; a
    # NaN stress there is the way to say "none" and trains
    frames = ase.io.read(dataset, ":")
    molecule = ase.Atoms("Cu2", positions=[[0, 0, 0], [0, 0, 2.3]])
    molecule.calc = type(frames[0].calc)(molecule, energy=1.0, forces=np.zeros((2, 3)), stress=np.zeros(6))
    ase.io.write(bad, frames + [molecule])
    with pytest.raises(
        ValueError, match=r"1 structure has a stress label but no cell volume: structure 16 \(pbc="
    ):
        fit(tiny_options(bad), None, progress=False, log=quiet())
    slab = molecule.copy()
    slab.cell, slab.pbc = [3.0, 3.0, 0.0], [True, True, False]
    slab.calc = type(frames[0].calc)(slab, energy=1.0, forces=np.zeros((2, 3)), stress=np.zeros(6))
    ase.io.write(bad, [molecule] + frames + [slab])
    options = tiny_options(bad)
    options["validation_set"] = 0.0
    with pytest.raises(
        ValueError,
        match=r"2 structures have a stress label but no cell volume: structures 0 "
        r"\(pbc=\[False, False, False\]\), 17 \(pbc=\[True, True, False\]\)",
    ):
        fit(options, None, progress=False, log=quiet())
    molecule.calc.results["stress"] = np.full(6, np.nan)
    ase.io.write(bad, frames + [molecule])
    fit(tiny_options(bad, num_epochs=1), tmp_path / "nan_stress", progress=False, log=quiet())
    # Missing file.
    with pytest.raises(FileNotFoundError, match="not found"):
        fit(tiny_options(tmp_path / "nope.xyz"), None, progress=False, log=quiet())


def test_lengths_in_other_units_are_announced(dataset, tmp_path):
    """Data in bohr: converted to Å with the architecture's lengths in Å, which
    metatrain (training in the data's unit) does not do: the log says so."""
    import ase.io

    frames = ase.io.read(dataset, ":8")
    bohr = 0.5291772105448199
    for atoms in frames:
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        atoms.calc = None
        atoms.set_cell(atoms.cell[:] / bohr, scale_atoms=True)
        atoms.info["E"] = energy
        atoms.arrays["F"] = forces * bohr
    ase.io.write(tmp_path / "bohr.xyz", frames)
    options = tiny_options(dataset, num_epochs=1)
    options["training_set"] = {
        "systems": {"read_from": str(tmp_path / "bohr.xyz"), "length_unit": "bohr"},
        "targets": {"energy": {"key": "E", "forces": {"key": "F"}, "stress": False}},
    }
    lines = []
    fit(options, None, progress=False, log=quiet(lines))
    assert any(
        line.startswith("note: lengths in bohr are converted to Å") and "cutoff 3" in line for line in lines
    ), lines
    lines.clear()
    fit(tiny_options(dataset, num_epochs=1), None, progress=False, log=quiet(lines))
    assert not any("converted to Å" in line for line in lines)


@pytest.mark.parametrize(
    "targets, loss, expected",
    [
        # metatrain reads no derivatives for a target not named 'energy' by default
        (
            {"mtt::U0": {"key": "energy"}},
            None,
            {
                "forces": "forces labels (key 'forces'), but the loss leaves them out: the energy "
                "target's 'forces' entry in 'training_set.targets' is off",
                "stress": "stress labels (key 'stress'), but the loss leaves them out",
            },
        ),
        ({"energy": {"stress": False}}, None, {"stress": "Set 'stress: true' (or {key: K}) there"}),
        (
            {"energy": {}},
            {"energy": {"forces": 0}},
            {
                "forces": "forces labels (key 'forces'), but the loss weight of the forces term is 0: they "
                "are not trained on. Give 'architecture.training.loss.energy.forces' a weight > 0"
            },
        ),
        ({"energy": {}}, None, {}),
        ({"mtt::U0": {"key": "energy", "quantity": "energy"}}, None, {}),
    ],
)
def test_labels_the_loss_leaves_out_are_warned(dataset, targets, loss, expected):
    """Forces or stresses in the training file that the loss does not use (an entry
    off, a target of another name, a zero weight): one warning each, naming the
    label, the file and the option that turns it on."""
    options = tiny_options(dataset, num_epochs=0)
    if loss is not None:
        options["architecture"]["training"]["loss"] = loss
    options["training_set"] = {"systems": str(dataset), "targets": targets}
    lines = []
    fit(options, None, progress=False, log=quiet(lines))
    warnings = [line for line in lines if line.startswith("warning: training_set: ")]
    assert len(warnings) == len(expected), warnings
    for label, text in expected.items():
        (line,) = [w for w in warnings if f"have {label} labels" in w]
        assert str(dataset) in line and text in line, line


def test_virials_left_out_are_warned(dataset, tmp_path):
    """Virials in the file while no stress is trained: the virial entry is off by
    default. A virial beside a trained stress is another label of the same quantity."""
    import ase.io

    frames = ase.io.read(dataset, ":")
    for atoms in frames:
        energy, stress = atoms.get_potential_energy(), atoms.get_stress(voigt=False)
        atoms.calc = None
        atoms.info["energy"] = energy
        atoms.info["virial"] = -stress * atoms.get_volume()
    ase.io.write(tmp_path / "virial.xyz", frames)
    lines = []
    fit(tiny_options(tmp_path / "virial.xyz", num_epochs=0), None, progress=False, log=quiet(lines))
    (line,) = [line for line in lines if line.startswith("warning: training_set: ")]
    assert "have virial labels (key 'virial')" in line and "Set 'virial: true'" in line
    for atoms in frames:
        atoms.info["stress"] = atoms.info["virial"] / -atoms.get_volume()
    ase.io.write(tmp_path / "both.xyz", frames)
    lines = []
    fit(tiny_options(tmp_path / "both.xyz", num_epochs=0), None, progress=False, log=quiet(lines))
    assert not [line for line in lines if line.startswith("warning: training_set: ")], lines
