"""Units of the labels petfunc reads: factors to eV and Å.

petfunc computes in Å and eV (forces eV/Å, stress eV/Å³). Dataset files may give
energies and lengths in other units (metatrain's ``energy.unit`` and
``systems.length_unit`` options); these factors convert them.
"""

from __future__ import annotations


# Factors to eV and Å: metatomic's (``metatomic.torch.unit_conversion_factor``), the
# ones a metatrain model's outputs are converted with, so that labels read here and
# a metatrain model trained in the same unit agree to round-off (ASE's CODATA 2014
# values differ from them by up to 8e-9, relative: kcal/mol)
_HARTREE = 27.211386245981465
_RYDBERG = 13.605693122990733


def _units():
    energy = {
        "ev": 1.0,
        "mev": 1e-3,
        "hartree": _HARTREE,
        "ha": _HARTREE,
        "ry": _RYDBERG,
        "rydberg": _RYDBERG,
        "kcal/mol": 0.043364104241800934,
        "kj/mol": 0.010364269656262174,
    }
    length = {
        "angstrom": 1.0,
        "a": 1.0,
        "å": 1.0,
        "bohr": 0.5291772105448199,
        "nm": 10.0,
        "nanometer": 10.0,
    }
    return energy, length


def energy_unit_factor(unit: str) -> float:
    """eV per ``unit`` (``eV``, ``meV``, ``Hartree``, ``Ry``, ``kcal/mol``, ``kJ/mol``)."""
    table, _ = _units()
    key = str(unit).strip().lower()
    if key not in table:
        raise ValueError(f"unknown energy unit {unit!r}; known units: eV, meV, Hartree, Ry, kcal/mol, kJ/mol")
    return table[key]


def length_unit_factor(unit: str | None) -> float:
    """Å per ``unit`` (``angstrom``, ``bohr``, ``nm``); ``None`` means Å."""
    if unit is None:
        return 1.0
    _, table = _units()
    key = str(unit).strip().lower()
    if key not in table:
        raise ValueError(f"unknown length unit {unit!r}; known units: angstrom, bohr, nm")
    return table[key]
