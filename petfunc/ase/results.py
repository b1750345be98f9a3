"""ASE results of PET's outputs: energies, forces, stress in Voigt order, and the
spread of a committee, as metatomic's ASE calculator gives them for the same model."""

from __future__ import annotations

import warnings

import numpy as np
from ase.calculators.calculator import PropertyNotImplementedError
from ase.data import chemical_symbols
from ase.stress import full_3x3_to_voigt_6_stress

from petfunc.structures import state_from_info


def voigt(stress: np.ndarray) -> np.ndarray:
    """``[..., 3, 3] -> [..., 6]`` in ASE's order (xx, yy, zz, yz, xz, xy), the
    off-diagonal pairs averaged (PET's strain derivative is not exactly symmetric)."""
    return full_3x3_to_voigt_6_stress(stress)


def symbol(z: int) -> str:
    """The chemical symbol of atomic number ``z`` (``"Z=n"`` beyond the table)."""
    return chemical_symbols[z] if 0 <= z < len(chemical_symbols) else f"Z={z}"


def charge_and_spin_info(info) -> list:
    """The charge and spin multiplicity a conditioned model reads from ``atoms.info``,
    as plain values (numpy arrays do not compare to one bool)."""
    return [None if v is None else np.asarray(v).tolist() for v in state_from_info(info)]


def partly_periodic_stress_warning(named: str | None = None) -> str:
    """The warning for a stress of structures (``named``, or "the system") that are
    not periodic in all three directions: metatomic's, whose volume it copies."""
    return (
        f"stress requested but likely to be wrong for {named or 'the system'}: not periodic in all "
        "directions (computed with the ASE cell volume, as metatomic does)"
    )


def stress_wanted(atoms, properties) -> bool:
    """Whether a calculation of ``atoms`` stores a stress: for a periodic cell, or when
    asked for one with a cell of non-zero volume (a partly periodic structure, with
    metatomic's warning). Asking for the stress of a zero-volume cell raises
    :class:`~ase.calculators.calculator.PropertyNotImplementedError`."""
    volume = float(atoms.cell.volume)
    periodic = bool(np.all(atoms.pbc))
    if "stress" in properties:
        if volume <= 0.0:
            raise PropertyNotImplementedError(
                "stress is undefined for this structure: its cell has zero volume "
                f"(pbc={atoms.pbc.tolist()}); stress needs a periodic cell"
            )
        if not periodic:
            warnings.warn(partly_periodic_stress_warning(), stacklevel=3)
    return volume > 0.0 and (periodic or "stress" in properties)


def model_arrays(outputs, n_atoms: int):
    """``(energy, per-atom energies [n], forces [n, 3], strain derivative [3, 3])``
    of the first structure of ``(energies, per_atom, forces, strain)`` model outputs
    (float64 numpy; the padding structure after it is dropped)."""
    energies, per_atom, forces, strain = outputs
    return (
        energies[0].double().item(),
        per_atom[:n_atoms].double().cpu().numpy(),
        forces[:n_atoms].double().cpu().numpy(),
        strain[0].double().cpu().numpy(),
    )


def committee_arrays(outputs, n_atoms: int):
    """:func:`model_arrays` of committee outputs (a leading member axis):
    ``(energies [K], forces [K, n, 3], strain [K, 3, 3], per-atom [K, n])``."""
    energies, per_atom, forces, strain = outputs
    return (
        energies[:, 0].double().cpu().numpy(),
        forces[:, :n_atoms].double().cpu().numpy(),
        strain[:, 0].double().cpu().numpy(),
        per_atom[:, :n_atoms].double().cpu().numpy(),
    )


def uncertainty_outputs(committee: bool, llpr) -> list:
    """The uncertainty outputs of a calculator with a committee or LLPR weights."""
    if committee or (llpr is not None and "ensemble_weights" in llpr):
        return [
            "energy_uncertainty",
            "forces_uncertainty",
            "stress_uncertainty",
            "energy_ensemble",
            "forces_ensemble",
        ]
    return ["energy_uncertainty"] if llpr is not None else []


def results(partial: dict, energy: float, forces, strain, ensemble, volume: float | None) -> dict:
    """The calculator's ``results``: ``partial`` (per-atom energies, LLPR outputs),
    energy, forces, the stress ``strain / volume`` in Voigt order (``volume`` ``None``:
    no stress) and a committee's members and spread (``ensemble``, as returned by
    :func:`committee_arrays`, or ``None``)."""
    out = dict(partial)
    out["energy"] = energy
    out["free_energy"] = energy
    out["forces"] = forces
    if volume is not None:
        out["stress"] = voigt(strain / volume)
    if ensemble is not None:
        out["energy_ensemble"] = ensemble[0]
        out["forces_ensemble"] = ensemble[1]
        out.setdefault("energy_uncertainty", float(ensemble[0].std()))
        out["forces_uncertainty"] = ensemble[1].std(axis=0)
        if volume is not None:
            out["stress_uncertainty"] = voigt(ensemble[2] / volume).std(axis=0)
    return out
