"""Unit conversion factors (petfunc.units): metatomic's."""

from tests.helpers.io_setup import metatrain_reference


def test_unit_factors_are_metatomics():
    """Labels in kcal/mol (Hartree, Bohr...) are converted with metatomic's factors,
    as a metatrain model's outputs are: ASE's differ by up to 8e-9 (kcal/mol), which
    moved a fine-tuned kcal/mol model's composition weights by that much."""
    metatrain_reference()
    from metatomic.torch import unit_conversion_factor

    from petfunc.units import energy_unit_factor, length_unit_factor

    for unit in ("eV", "meV", "Hartree", "Ry", "kcal/mol", "kJ/mol"):
        assert energy_unit_factor(unit) == float(unit_conversion_factor(unit, "eV")), unit
    for unit in ("angstrom", "bohr", "nm"):
        assert length_unit_factor(unit) == float(unit_conversion_factor(unit, "angstrom")), unit
