"""The names of a dataset's targets, checked as metatrain checks them.

metatrain accepts a target named by metatomic's standard outputs (``energy``,
``energy/VARIANT``, ``non_conservative_force``, ...) or by its own non-standard
form ``mtt::NAME``, and refuses anything else. petfunc trains one energy target
per dataset: ``energy`` (forces and stress read by default), an energy variant
``energy/VARIANT`` or ``mtt::NAME`` (derivatives only where the section asks for
them, as in metatrain). A misspelt name (``enrgy``) would otherwise be taken for a
target of its own and train without the forces and stress the file holds.
"""

from __future__ import annotations

import difflib


#: metatomic's standard outputs (metatomic-torch 0.1, its deprecated plural
#: spellings included) other than ``energy``: valid metatrain targets that petfunc
#: does not train
OTHER_STANDARD_OUTPUTS = (
    "charge",
    "charges",
    "energy_ensemble",
    "energy_uncertainty",
    "feature",
    "features",
    "heat_flux",
    "mass",
    "masses",
    "momenta",
    "momentum",
    "non_conservative_force",
    "non_conservative_forces",
    "non_conservative_stress",
    "position",
    "positions",
    "spin_multiplicity",
    "velocities",
    "velocity",
)

#: the labels petfunc trains as the energy's derivatives (a target's own entries)
GRADIENT_NAMES = ("force", "stress", "virial")

ENERGY_ONLY = (
    "petfunc trains energies only (forces, stress and virials as the energy's derivatives, set "
    "under the energy target: targets: {energy: {forces: {key: K}}})"
)


def check_target_name(name, where: str) -> None:
    """Raise ``ValueError`` unless ``name`` (a key of the dataset section
    ``where``'s ``targets``) names an energy target petfunc trains: ``energy``,
    ``energy/VARIANT`` or ``mtt::NAME``.

    The error says whether the name is not a metatrain target name at all (with the
    closest valid one), metatrain's but not an energy (petfunc trains energies
    only), or a derivative written as a target of its own.
    """
    option = f"option '{where}.{name}'"
    if not isinstance(name, str):
        raise ValueError(f"option '{where}': target names are strings, got {name!r}")
    base, _, variant = name.partition("/")
    if base == "energy" and ("/" not in name or variant):
        return
    if "::" in name:
        domain, _, quantity = name.partition("::")
        if domain != "mtt":
            raise ValueError(
                f"{option}: target names with '::' must start with 'mtt::' (metatrain's prefix "
                f"for targets of your own); did you mean 'mtt::{quantity or domain}'?"
            )
        if not quantity or quantity.startswith("/"):
            raise ValueError(f"{option}: 'mtt::' needs a name after it, e.g. 'mtt::U0'")
        if quantity.startswith("aux::"):
            raise ValueError(
                f"{option}: 'mtt::aux::' names are metatrain's auxiliary outputs (uncertainties, "
                "features), not targets; name the energy 'energy' or 'mtt::NAME'"
            )
        return
    if base in OTHER_STANDARD_OUTPUTS:
        raise ValueError(f"{option}: {name!r} is a standard output petfunc does not train; {ENERGY_ONLY}")
    if any(g in name.lower() for g in GRADIENT_NAMES):
        raise ValueError(
            f"{option}: {name!r} looks like a derivative of the energy, which is not a target of its own "
            "(metatrain refuses it too); set it under the energy target, e.g. "
            "targets: {energy: {forces: {key: K}}}, or name a target of your own 'mtt::NAME'"
        )
    close = difflib.get_close_matches(name.lower(), ("energy",), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ValueError(
        f"{option}: unknown target name {name!r}{hint}. A target is named 'energy' (its forces and "
        f"stress are read by default), 'energy/VARIANT', or 'mtt::NAME' for one of your own "
        f"(here 'mtt::{name}'), as in metatrain"
    )
