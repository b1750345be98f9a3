"""Models, structures and the comparison of the metatomic export parity tests
(tests/parity/test_metatomic_export.py): a model exported with
``petfunc.export.export_metatomic`` and run by metatomic's ASE calculator against
``petfunc.ase.PETCalculator`` on the same weights. Needs metatrain and metatomic-ase.

``python -m tests.helpers.metatomic_export`` prints the table of every model kind x
structure (max relative errors of energy, forces and stress).
"""

from __future__ import annotations

import ase
import ase.build
import numpy as np
import torch

import petfunc


TYPES = (1, 6, 8)
SMALL = dict(d_pet=8, d_node=16, d_head=8, d_feedforward=16, num_heads=2, cutoff=3.0)

#: model kind -> the PETConfig fields that make it
KINDS = {
    "default": {},
    "adaptive cutoff": dict(num_neighbors_adaptive=5),
    "ZBL": dict(zbl=True),
    "long-range": dict(long_range=dict(enable=True)),
    "LoRA merged": {},
    "charge/spin conditioning": dict(system_conditioning=True),
}


def config_of(kind: str) -> petfunc.PETConfig:
    return petfunc.PETConfig(atomic_types=TYPES, **SMALL, **KINDS[kind])


def params_of(kind: str, config: petfunc.PETConfig):
    """Random float64 weights, perturbed so that no layer is near its initial
    value, with a non-trivial composition and scale; for ``"LoRA merged"`` random
    adapters merged into them (as ``petfunc.load_model`` merges a fine-tuning's)."""
    params = petfunc.PET(config).init(seed=3, dtype=torch.float64)
    generator = torch.Generator().manual_seed(4)
    flat = petfunc.tree.flatten(params)
    for name, value in flat.items():
        flat[name] = value + 0.2 * torch.randn(value.shape, generator=generator, dtype=value.dtype)
    flat["composition_weights"] = torch.tensor([-1.5, -4.0, -3.0], dtype=torch.float64)
    flat["energy_scale"] = torch.tensor(0.7, dtype=torch.float64)
    params = petfunc.tree.unflatten(flat)
    if kind == "LoRA merged":
        adapted = petfunc.lora.attach(params, rank=2, seed=5)
        adapters = petfunc.tree.flatten(adapted[petfunc.lora.KEY])
        adapted[petfunc.lora.KEY] = petfunc.tree.unflatten(
            {
                k: v + 0.1 * torch.randn(v.shape, generator=generator, dtype=v.dtype)
                for k, v in adapters.items()
            }
        )
        params = petfunc.lora.merge(adapted, petfunc.lora.scaling_of(8.0, adapted))
    return params


def structures() -> dict[str, ase.Atoms]:
    """A molecule, a periodic cell wider than the 3 Å cutoff and one narrower, each
    with atoms closer than the sum of their covalent radii (so that ZBL acts)."""
    molecule = ase.build.molecule("CH3CH2OH")
    molecule.positions *= 0.85
    molecule.rattle(0.05, seed=1)
    molecule.info.update(charge=1, spin_multiplicity=2)
    periodic = ase.build.bulk("C", "diamond", a=3.3, cubic=True)
    periodic.symbols[[1, 6]] = "O"
    periodic.symbols[[3]] = "H"
    periodic.rattle(0.08, seed=2)
    periodic.cell[1, 0] += 0.3  # triclinic
    periodic.info.update(charge=-1, spin_multiplicity=1)
    small = ase.Atoms(
        "CO", positions=[[0, 0, 0], [0.8, 0.9, 0.7]], cell=[[0, 1.7, 1.7], [1.7, 0, 1.7], [1.7, 1.7, 0]]
    )
    small.pbc = True
    small.rattle(0.03, seed=3)
    return {"molecule": molecule, "periodic cell": periodic, "cell < cutoff": small}


def results(calculator, atoms: ase.Atoms) -> dict[str, np.ndarray]:
    atoms = atoms.copy()
    atoms.calc = calculator
    out = {"energy": np.array([atoms.get_potential_energy()]), "forces": atoms.get_forces()}
    if atoms.pbc.any():
        out["stress"] = atoms.get_stress()
    return out


def relative_errors(got: dict, expected: dict) -> dict[str, float]:
    """max |got - expected| / max |expected| of each quantity."""
    return {
        name: float(np.abs(got[name] - value).max() / max(np.abs(value).max(), 1e-300))
        for name, value in expected.items()
    }


def compare(kind: str, path, names=None) -> dict[str, dict[str, float]]:
    """Export the ``kind`` model to ``path`` and compare metatomic's ASE calculator on
    it with petfunc's on the same weights: ``{structure: {quantity: max relative
    error}}``."""
    from metatomic_ase import MetatomicCalculator

    config = config_of(kind)
    params = params_of(kind, config)
    petfunc.export.export_metatomic(config, params, path)
    exported = MetatomicCalculator(str(path), device="cpu")
    reference = petfunc.ase.PETCalculator(config, params)
    return {
        name: relative_errors(results(exported, atoms), results(reference, atoms))
        for name, atoms in structures().items()
        if names is None or name in names
    }


def table(rows: dict[tuple[str, str], dict[str, float]]) -> str:
    """A markdown table of ``{(kind, structure): {quantity: error}}``."""
    lines = [
        "| model | structure | energy | forces | stress |",
        "|---|---|---|---|---|",
    ]
    for (kind, name), errors in rows.items():
        cells = [f"{errors[q]:.1e}" if q in errors else "-" for q in ("energy", "forces", "stress")]
        lines.append(f"| {kind} | {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    import tempfile
    from pathlib import Path

    rows = {}
    with tempfile.TemporaryDirectory() as folder:
        for kind in KINDS:
            # ZBL with float64 coefficients, as in the parity test (see there)
            torch.set_default_dtype(torch.float64 if kind == "ZBL" else torch.float32)
            for name, errors in compare(kind, Path(folder) / "model.pt").items():
                rows[(kind, name)] = errors
    print(table(rows))
