"""The ASE calculator (petfunc.ase.PETCalculator).

* parity with metatomic's ASE calculator running metatrain's exported PET on the same
  weights (float64): energy, per-atom energies, forces, stress, charge and spin;
* the stress conventions, the properties offered, one model call for every result;
* float32 atoms far from the cell, unknown species, a molecule's stress;
* committee uncertainties, the constructors, pickling.
"""

import pickle
import warnings

import ase
import ase.build
import numpy as np
import pytest
import torch
from ase.calculators.calculator import PropertyNotImplementedError

import petfunc
from petfunc.ase import BatchEvaluator, PETCalculator
from petfunc.structures import prepare_atoms
from tests.helpers.ase_setup import (
    COMPOSITION,
    CONFIG,
    SMALL,
    carbon_cell,
    committee,
    ethanol,
    make_params,
    metatomic_calculator,
    relative,
    slab,
    triclinic_cell,
)


# ---------------------------------------------------------------------------------------
# parity with metatomic's calculator


@pytest.fixture(scope="module")
def metatomic(params):
    return metatomic_calculator(CONFIG, params)


PARITY_RTOL = 1e-9


def compare_with_metatomic(reference, calc, atoms, stress=True):
    a, b = atoms.copy(), atoms.copy()
    a.calc, b.calc = reference, calc
    # energies compared without the (identical, large) composition term
    comp = np.array(COMPOSITION)[[CONFIG.atomic_types.index(z) for z in atoms.numbers]]
    errors = {
        "energy": relative(b.get_potential_energy() - comp.sum(), a.get_potential_energy() - comp.sum()),
        "free_energy": relative(
            b.calc.get_property("free_energy", b) - comp.sum(), a.get_potential_energy() - comp.sum()
        ),
        "energies": relative(b.get_potential_energies() - comp, a.get_potential_energies() - comp),
        "forces": relative(b.get_forces(), a.get_forces()),
    }
    if stress:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            errors["stress"] = relative(b.get_stress(), a.get_stress())
    return errors


def test_charge_and_spin_conditioning_matches_metatomic():
    """A model with charge/spin conditioning (random, non-zero gate) reads
    ``atoms.info`` as metatomic's calculator does, and changing the charge or spin
    invalidates the cached results."""
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), system_conditioning=True, **SMALL)
    params = make_params(config, seed=2)
    generator = torch.Generator().manual_seed(0)
    gate = params["system_conditioning"]["project"]["2"]
    for name in gate:
        gate[name] = torch.randn(gate[name].shape, generator=generator, dtype=torch.float64) / 4
    reference = metatomic_calculator(config, params)
    atoms = carbon_cell()
    atoms.calc = PETCalculator(config, params)  # stays attached while info changes
    energies = []
    for info in ({}, {"charge": 1}, {"charge": -2, "spin_multiplicity": 3}, {"charge": -2, "spin": 2}):
        atoms.info.clear()
        atoms.info.update(info)
        errors = compare_with_metatomic(reference, PETCalculator(config, params), atoms)
        assert max(errors.values()) < PARITY_RTOL, (info, errors)
        fresh = atoms.copy()
        fresh.calc = PETCalculator(config, params)
        energies.append(atoms.get_potential_energy())  # recomputed: info changed
        assert energies[-1] == fresh.get_potential_energy()
    assert len(set(energies)) == 4
    atoms.info["charge"] = 11
    with pytest.raises(ValueError, match=r"charge 11 is outside the model's range \[-10, 10\]"):
        atoms.get_potential_energy()


@pytest.mark.parametrize("structure", [ethanol, carbon_cell, triclinic_cell, slab])
def test_matches_metatomic_calculator(structure, params, metatomic):
    atoms = structure()
    stress = bool(atoms.cell.volume > 0)
    errors = compare_with_metatomic(metatomic, PETCalculator(CONFIG, params), atoms, stress)
    assert max(errors.values()) < PARITY_RTOL, errors


def test_matches_metatomic_calculator_default_architecture():
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    params = make_params(config, seed=0)
    reference = metatomic_calculator(config, params)
    for atoms in (ethanol(), carbon_cell()):
        errors = compare_with_metatomic(reference, PETCalculator(config, params), atoms, atoms.pbc.all())
        assert max(errors.values()) < PARITY_RTOL, errors


# ---------------------------------------------------------------------------------------
# conventions and properties


def test_stress_conventions(params):
    # Voigt order, sign and symmetrisation from the strain derivative, V = ASE volume
    atoms = carbon_cell()
    calc = PETCalculator(CONFIG, params)
    atoms.calc = calc
    efs = petfunc.energy_forces_strain_derivative(petfunc.PET(CONFIG).energy)
    _, _, de_deps = efs(params, *petfunc.from_atoms(atoms, CONFIG, dtype=torch.float64))
    sigma = de_deps[0].numpy() / atoms.get_volume()
    sigma = (sigma + sigma.T) / 2
    expected = [sigma[0, 0], sigma[1, 1], sigma[2, 2], sigma[1, 2], sigma[0, 2], sigma[0, 1]]
    np.testing.assert_allclose(atoms.get_stress(), expected, rtol=1e-12, atol=1e-15)
    # finite strain: sigma_aa = (1/V) dE/d eps_aa
    h = 1e-5
    energies = []
    for sign in (1, -1):
        strained = atoms.copy()
        strained.calc = calc
        strained.set_cell(atoms.cell[:] @ np.diag([1 + sign * h, 1, 1]), scale_atoms=True)
        energies.append(strained.get_potential_energy())
    numeric = (energies[0] - energies[1]) / (2 * h) / atoms.get_volume()
    assert abs(numeric - atoms.get_stress()[0]) < 1e-6 * max(1.0, abs(numeric))


def test_molecule_has_no_stress(params):
    atoms = ethanol()
    atoms.calc = PETCalculator(CONFIG, params)
    atoms.get_forces()
    with pytest.raises(PropertyNotImplementedError, match="zero volume"):
        atoms.get_stress()


def test_energies_sum_to_energy(params):
    for atoms in (ethanol(), carbon_cell()):
        atoms.calc = PETCalculator(CONFIG, params)
        assert atoms.get_potential_energies().shape == (len(atoms),)
        np.testing.assert_allclose(
            atoms.get_potential_energies().sum(), atoms.get_potential_energy(), rtol=1e-13
        )


def test_one_model_call_gives_every_result(params, monkeypatch):
    """Per-atom energies come with every calculation: asking for them after the
    forces and stress does not evaluate the model again."""
    atoms = carbon_cell()
    atoms.calc = PETCalculator(CONFIG, params)
    calls = []
    evaluate = atoms.calc._evaluate
    monkeypatch.setattr(atoms.calc, "_evaluate", lambda *a: calls.append(1) or evaluate(*a))
    atoms.get_forces(), atoms.get_stress(), atoms.get_potential_energy()
    energies = atoms.get_potential_energies()
    assert len(calls) == 1 and energies.sum() == pytest.approx(atoms.get_potential_energy(), rel=1e-13)


def test_implemented_properties_follow_the_model(params):
    """A plain calculator does not offer uncertainties (asking for one raises, before
    anything is computed); a committee offers them all, LLPR without ensemble
    weights only the energy's."""
    plain = PETCalculator(CONFIG, params)
    assert (
        "energy_uncertainty" not in plain.implemented_properties
        and "energies" in plain.implemented_properties
    )
    atoms = carbon_cell()
    atoms.calc = plain
    with pytest.raises(PropertyNotImplementedError):
        atoms.calc.get_property("energy_uncertainty", atoms)
    committee_calc = PETCalculator(CONFIG, params, ensemble_params=committee())
    assert {
        "energy_uncertainty",
        "forces_uncertainty",
        "stress_uncertainty",
        "energy_ensemble",
        "forces_ensemble",
    } <= set(committee_calc.implemented_properties)
    llpr = PETCalculator(CONFIG, params, llpr={"covariance": torch.eye(3, dtype=torch.float64)})
    assert (
        llpr.implemented_properties[-1] == "energy_uncertainty"
        and "forces_uncertainty" not in llpr.implemented_properties
    )
    assert PETCalculator.implemented_properties == ["energy", "free_energy", "energies", "forces", "stress"]


def test_float32_atoms_far_from_the_cell(params):
    """A float32 model sees the atoms wrapped into the cell (in float64): atoms that
    diffused 100 cells away give the forces of the wrapped structure. Unwrapped,
    the float32 edge vectors would lose ~1e-4 eV/Å at 700 Å from the origin."""
    params32 = petfunc.tree.tree_map(lambda x: x.float(), params)
    atoms = carbon_cell()
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    f64, s64 = reference.get_forces(), reference.get_stress()
    far = atoms.copy()
    far.positions += np.array([100, -70, 30]) @ atoms.cell.array + atoms.cell.array[0] * 0.5
    far.calc = PETCalculator(CONFIG, params32)
    assert np.abs(far.get_forces() - f64).max() < 2e-5
    assert np.abs(far.get_stress() - s64).max() < 1e-6
    assert np.allclose(far.positions, atoms.positions + np.array([100.5, -70, 30]) @ atoms.cell.array)
    (batched,) = BatchEvaluator(CONFIG, params32, stress=True)([far])
    assert np.abs(batched["forces"] - f64).max() < 2e-5 and np.abs(batched["stress"] - s64).max() < 1e-6
    # a slab moves only along its periodic directions
    structure = prepare_atoms(far, CONFIG, wrap=True)
    frac = np.linalg.solve(atoms.cell.array.T, structure.positions.T).T
    assert frac.min() > -1e-9 and frac.max() < 1 + 1e-9
    flat = far.copy()
    flat.pbc = [True, True, False]
    structure = prepare_atoms(flat, CONFIG, wrap=True)
    frac = np.linalg.solve(atoms.cell.array.T, structure.positions.T).T
    assert frac[:, :2].min() > -1e-9 and frac[:, :2].max() < 1 + 1e-9
    np.testing.assert_allclose(
        frac[:, 2], np.linalg.solve(atoms.cell.array.T, far.positions.T).T[:, 2], atol=1e-9
    )


def test_float32_molecule_far_from_the_origin(params):
    """A float32 model sees a molecule centred in float64: at 1e6 Å its forces are
    those of float64 to 1e-5 (rounded coordinates gave 16 % errors); the user's
    atoms keep their positions."""
    params32 = petfunc.tree.tree_map(lambda x: x.float(), params)
    reference = ethanol()
    reference.calc = PETCalculator(CONFIG, params)
    far = ethanol()
    far.positions += [1e6, 0.0, 0.0]
    given = far.positions.copy()
    far.calc = PETCalculator(CONFIG, params32)
    assert relative(far.get_forces(), reference.get_forces()) < 1e-5
    assert far.get_potential_energy() == pytest.approx(reference.get_potential_energy(), rel=1e-6)
    assert np.array_equal(far.positions, given)
    (batched,) = BatchEvaluator(CONFIG, params32)([far])
    assert relative(batched["forces"], reference.get_forces()) < 1e-5
    assert np.array_equal(far.positions, given)


def test_unknown_species(params):
    atoms = ase.build.bulk("Si", "diamond", a=5.43)
    atoms.calc = PETCalculator(CONFIG, params)
    with pytest.raises(ValueError, match=r"Si \(Z=14\).*H, C, N, O"):
        atoms.get_potential_energy()


# ---------------------------------------------------------------------------------------
# committee (eager: torch.func.vmap over the members)


def test_committee_uncertainty(params):
    members = committee()
    atoms = carbon_cell()
    atoms.calc = PETCalculator(CONFIG, params, ensemble_params=petfunc.tree.stack(members))
    energy = atoms.get_potential_energy()
    results = atoms.calc.results

    # a loop over single-member calculators
    singles = []
    for member in members:
        a = atoms.copy()
        a.calc = PETCalculator(CONFIG, member)
        singles.append((a.get_potential_energy(), a.get_forces(), a.get_stress()))
    energies = np.array([s[0] for s in singles])
    forces = np.stack([s[1] for s in singles])
    stresses = np.stack([s[2] for s in singles])

    assert results["energy_ensemble"].shape == (3,)
    assert results["forces_ensemble"].shape == (3, len(atoms), 3)
    assert results["forces_uncertainty"].shape == (len(atoms), 3)
    assert results["stress_uncertainty"].shape == (6,)
    np.testing.assert_allclose(results["energy_ensemble"], energies, rtol=1e-12)
    np.testing.assert_allclose(results["forces_ensemble"], forces, rtol=0, atol=1e-11)
    np.testing.assert_allclose(atoms.calc.get_property("energy_uncertainty"), energies.std(), rtol=1e-10)
    np.testing.assert_allclose(results["forces_uncertainty"], forces.std(axis=0), rtol=0, atol=1e-11)
    np.testing.assert_allclose(results["stress_uncertainty"], stresses.std(axis=0), rtol=0, atol=1e-11)
    # the prediction is the main model's
    main = atoms.copy()
    main.calc = PETCalculator(CONFIG, params)
    assert energy == pytest.approx(main.get_potential_energy(), rel=1e-14)

    # without main params, the committee mean is the prediction
    mean = atoms.copy()
    mean.calc = PETCalculator(CONFIG, None, ensemble_params=members)
    assert mean.get_potential_energy() == pytest.approx(energies.mean(), rel=1e-12)
    np.testing.assert_allclose(mean.get_forces(), forces.mean(axis=0), rtol=0, atol=1e-11)
    np.testing.assert_allclose(mean.get_potential_energies().sum(), energies.mean(), rtol=1e-12)


# ---------------------------------------------------------------------------------------
# constructors, pickling


def test_from_checkpoint(tmp_path, params):
    path = tmp_path / "model.pt"
    petfunc.save_params(path, CONFIG, params)
    atoms = carbon_cell()
    atoms.calc = PETCalculator.from_checkpoint(path)
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    assert atoms.get_potential_energy() == reference.get_potential_energy()

    # a training checkpoint (petfunc train's): its best parameters are used
    training = tmp_path / "training.ckpt"
    other = make_params(seed=5)
    petfunc.io.write_checkpoint(
        training,
        config=CONFIG,
        params=other,
        opt_state=(),
        epoch=3,
        step=30,
        best_epoch=2,
        best_metric=0.5,
        best_params=params,
        composition=params["composition_weights"],
        energy_scale=float(params["energy_scale"]),
        dtype=torch.float64,
        seed=0,
        options={},
        history=[],
        split={},
        world_size=1,
        version=petfunc.__version__,
    )
    atoms.calc = PETCalculator.from_checkpoint(training)
    assert atoms.get_potential_energy() == reference.get_potential_energy()

    junk = tmp_path / "junk.pt"
    torch.save({"something": torch.zeros(2)}, junk)
    with pytest.raises(ValueError, match="from_metatrain"):
        PETCalculator.from_checkpoint(junk)


def test_from_metatrain_exported_model(tmp_path, params, metatomic):
    path = tmp_path / "exported.pt"
    metatomic.model().save(str(path))
    atoms = carbon_cell()
    atoms.calc = PETCalculator.from_metatrain(path)
    reference = atoms.copy()
    reference.calc = PETCalculator(CONFIG, params)
    assert atoms.calc.config == CONFIG
    assert relative(atoms.get_forces(), reference.get_forces()) < 1e-12


def test_calculator_pickles_and_exports_properties(params):
    """A calculator travels to other processes (a multiprocessing pool): it pickles
    without its derivative closures. The copy gives the same numbers, a committee
    included."""
    atoms = ase.build.molecule("CH3CH2OH")
    for calc in (
        PETCalculator(CONFIG, params),
        PETCalculator(
            CONFIG, params, ensemble_params=[params, petfunc.PET(CONFIG).init(seed=5, dtype=torch.float64)]
        ),
    ):
        if calc.ensemble_params is not None:  # ASE's Properties take energy_ensemble
            a = atoms.copy()
            a.calc = calc
            assert a.get_properties(["energy"])["energy"] == a.get_potential_energy()
        copy = pickle.loads(pickle.dumps(calc))
        for key in ("energy", "forces"):
            a, b = atoms.copy(), atoms.copy()
            a.calc, b.calc = calc, copy
            np.testing.assert_array_equal(a.calc.get_property(key, a), b.calc.get_property(key, b))
