"""Predictions of a model and their errors: what ``petfunc eval`` reports and writes,
and what a run reports at its end (test set, parity plots).

Energies in eV, forces in eV/Å, stresses in eV/Å³ (the ``*_ref`` labels too),
whatever units the data were read in.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ase
import ase.io
import numpy as np
import torch
from ase.calculators.singlepoint import SinglePointCalculator

from petfunc import tree
from petfunc._files import atomic_write
from petfunc.ase import voigt
from petfunc.config import PETConfig
from petfunc.data import Sample, read_labelled
from petfunc.derivatives import energy_and_forces, energy_forces_strain_derivative
from petfunc.devices import resolve_device
from petfunc.io import load_model, metatrain_units
from petfunc.io.checkpoint import check_checkpoint, is_checkpoint
from petfunc.io.load import torch_payload
from petfunc.model import PET
from petfunc.structures import collate
from petfunc.trainer.memory import EVALUATION_ADVICE, reporting_out_of_memory
from petfunc.trainer.options import dataset_sections
from petfunc.units import energy_unit_factor, length_unit_factor


def _evaluate_structures(config: PETConfig, params, samples: Sequence[Sample], batch_size: int, stress: bool):
    """Yield ``(sample, energy, forces, strain_derivative)`` for every sample (eV, eV/Å,
    eV; the strain derivative ``None`` without ``stress`` and for structures that are
    not periodic in all three directions, whose stress is undefined), in batches.
    A batch that runs out of memory raises :class:`~petfunc.trainer.memory.OutOfMemory`."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    model = PET(config)
    leaves = tree.flatten(params)
    dtype = next(v.dtype for k, v in leaves.items() if k not in ("composition_weights", "energy_scale"))
    device = next(iter(leaves.values())).device
    fn = (energy_forces_strain_derivative if stress else energy_and_forces)(model.energy, "autograd")
    for start in range(0, len(samples), batch_size):
        chunk = list(samples[start : start + batch_size])
        doing = f"in the evaluation of structures {start + 1}..{start + len(chunk)} of {len(samples)}"
        with reporting_out_of_memory(doing, device, EVALUATION_ADVICE):
            inputs = collate([s.structure for s in chunk], config, dtype=dtype, device=device)
        with reporting_out_of_memory(doing, device, EVALUATION_ADVICE, inputs):
            result = fn(params, *inputs)
        energies = result[0].detach().to("cpu", torch.float64).numpy()
        forces = result[1].detach().to("cpu", torch.float64).numpy()
        offsets = np.cumsum([0] + [len(s) for s in chunk])
        for k, s in enumerate(chunk):
            strain = None
            if stress and np.all(s.structure.pbc) and abs(np.linalg.det(s.structure.cell)) > 0:
                strain = result[2][k].detach().to("cpu", torch.float64).numpy()
            yield s, float(energies[k]), forces[offsets[k] : offsets[k + 1]], strain


def predict(
    config: PETConfig, params, samples: Sequence[Sample], batch_size: int = 16, stress: bool = True
) -> dict:
    """Energies, forces and stresses of ``samples`` next to their labels (eV, Å).

    Returns a dict of numpy arrays: ``energy_per_atom``/``energy_per_atom_ref``
    ``[n]`` (NaN where unlabelled), ``forces``/``forces_ref`` ``[n_labelled_atoms, 3]``,
    ``stress``/``stress_ref`` ``[n_labelled_periodic, 3, 3]`` (eV/Å^3), and ``n_atoms``.
    """
    want_stress = stress and any(s.stress is not None or s.virial is not None for s in samples)
    return _error_arrays(_evaluate_structures(config, params, samples, batch_size, want_stress))


def _error_arrays(evaluated) -> dict:
    """:func:`predict`'s arrays from ``(sample, energy, forces, strain_derivative)``
    tuples (:func:`_evaluate_structures`)."""
    out = {
        k: []
        for k in (
            "energy_per_atom",
            "energy_per_atom_ref",
            "forces",
            "forces_ref",
            "stress",
            "stress_ref",
            "n_atoms",
        )
    }
    for s, energy, forces, strain in evaluated:
        n = len(s)
        out["n_atoms"].append(n)
        out["energy_per_atom"].append(energy / n)
        out["energy_per_atom_ref"].append(s.energy / n if s.energy is not None else math.nan)
        if s.forces is not None:
            out["forces"].append(forces)
            out["forces_ref"].append(np.asarray(s.forces))
        if strain is not None and (s.stress is not None or s.virial is not None):
            volume = abs(np.linalg.det(s.structure.cell))
            out["stress"].append(strain / volume)
            out["stress_ref"].append(s.strain_derivative() / volume)
    result = {}
    for key, values in out.items():
        if key.startswith("forces"):
            result[key] = np.concatenate(values) if values else np.zeros((0, 3))
        elif key.startswith("stress"):
            result[key] = np.stack(values) if values else np.zeros((0, 3, 3))
        else:
            result[key] = np.asarray(values, dtype=np.float64)
    return result


def write_predictions(
    config: PETConfig,
    params,
    samples: Sequence[Sample],
    path,
    batch_size: int = 16,
    energy_unit: str = "eV",
    length_unit: str = "angstrom",
) -> Path:
    """Write the model's predictions for ``samples`` to the extxyz file ``path``: one
    frame per structure (its atoms, positions, cell and pbc) whose results are the
    predicted ``energy``, ``forces`` and, for periodic cells, ``stress`` (ASE's Voigt
    order, symmetrised as :class:`petfunc.ase.PETCalculator` does), so
    ``ase.io.read`` gives them back as ``atoms.get_potential_energy()`` etc. Lengths
    and energies are in ``length_unit`` and ``energy_unit``: those the samples were
    read in give a file in the units of its input (as ``mtt eval`` writes a model's
    data units). Written atomically."""
    return _write_results(
        _evaluate_structures(config, params, samples, batch_size, stress=True), path, energy_unit, length_unit
    )


def _write_results(evaluated, path, energy_unit: str = "eV", length_unit: str = "angstrom") -> Path:
    """:func:`write_predictions` from ``(sample, energy, forces, strain_derivative)``
    tuples (:func:`_evaluate_structures` with ``stress=True``)."""
    ev, angstrom = energy_unit_factor(energy_unit or "eV"), length_unit_factor(length_unit)
    frames = []
    for s, energy, forces, strain in evaluated:
        structure = s.structure
        cell = np.asarray(structure.cell, dtype=np.float64)
        atoms = ase.Atoms(
            numbers=np.asarray(structure.numbers),
            positions=np.asarray(structure.positions) / angstrom,
            cell=cell / angstrom,
            pbc=np.asarray(structure.pbc),
        )
        results = {"energy": energy / ev, "forces": np.asarray(forces) * (angstrom / ev)}
        if strain is not None:
            results["stress"] = voigt(strain / abs(np.linalg.det(cell))) * (angstrom**3 / ev)
        atoms.calc = SinglePointCalculator(atoms, **results)
        frames.append(atoms)
    path = Path(path)
    text = io.StringIO()
    ase.io.write(text, frames, format="extxyz")
    atomic_write(path, lambda handle: handle.write(text.getvalue()), text=True)
    return path


def error_metrics(pred: dict) -> dict[str, float]:
    """RMSE and MAE of energies per atom (eV/atom), forces (eV/Å), stress (eV/Å^3),
    over the components with labels (``*_count``). NaN predictions make them NaN
    and are counted in ``*_nan_predictions``."""
    out = {}
    pairs = {
        "energy_per_atom": (pred["energy_per_atom"], pred["energy_per_atom_ref"]),
        "forces": (pred["forces"], pred["forces_ref"]),
        "stress": (pred["stress"], pred["stress_ref"]),
    }
    for name, (p, r) in pairs.items():
        p, r = np.asarray(p, dtype=np.float64).reshape(-1), np.asarray(r, dtype=np.float64).reshape(-1)
        labelled = ~np.isnan(r)  # a missing label is skipped; a NaN prediction is not
        diff = p[labelled] - r[labelled]
        if diff.size:
            out[f"{name}_rmse"] = float(np.sqrt(np.mean(diff**2)))
            out[f"{name}_mae"] = float(np.mean(np.abs(diff)))
            out[f"{name}_count"] = int(diff.size)
            nan = int(np.count_nonzero(np.isnan(p[labelled])))
            if nan:
                out[f"{name}_nan_predictions"] = nan
    return out


def parity_plot(pred: dict, path, title: str = "") -> None:
    """Predicted vs reference energies per atom, forces (and stress) as a PNG."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    panels = [("energy_per_atom", "energy per atom (eV/atom)")]
    if len(pred["forces"]):
        panels.append(("forces", "force components (eV/Å)"))
    if len(pred["stress"]):
        panels.append(("stress", "stress components (eV/Å³)"))
    fig = Figure(figsize=(4.2 * len(panels), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    errors = error_metrics(pred)
    for i, (key, label) in enumerate(panels):
        ax = fig.add_subplot(1, len(panels), i + 1)
        x = np.asarray(pred[f"{key}_ref"]).reshape(-1)
        y = np.asarray(pred[key]).reshape(-1)
        keep = ~(np.isnan(x) | np.isnan(y))
        x, y = x[keep], y[keep]
        if x.size:
            lo, hi = float(min(x.min(), y.min())), float(max(x.max(), y.max()))
            pad = 0.05 * (hi - lo or 1.0)
            ax.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.6", lw=1, zorder=0)
            ax.scatter(x, y, s=6, alpha=0.5, edgecolors="none")
            ax.set_xlim(lo - pad, hi + pad)
            ax.set_ylim(lo - pad, hi + pad)
        ax.set_aspect("equal")
        ax.set_xlabel(f"reference {label}")
        ax.set_ylabel(f"predicted {label}")
        if f"{key}_rmse" in errors:
            ax.set_title(f"RMSE {errors[f'{key}_rmse']:.3g}, MAE {errors[f'{key}_mae']:.3g}", fontsize=9)
    if title:
        fig.suptitle(title)
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))


def training_label_options(path, target: str | None = None) -> dict[str, Any]:
    """Label keys and units of the first training file of a petfunc training
    checkpoint's options (``energy_key``, ``forces_key``, ``stress_key``,
    ``virial_key``, ``energy_unit``, ``length_unit``; only those the options set);
    for a metatrain checkpoint or exported model, the units of its training data
    (what ``mtt eval`` reads a file without units in); else ``{}``."""
    payload, _ = torch_payload(path)  # None: a metatrain model, or no model at all
    if isinstance(payload, dict):  # petfunc's own files; only a training checkpoint has options
        if not is_checkpoint(payload):
            return {}
        check_checkpoint(payload, path)  # a damaged file says so before its options are read
        section = dataset_sections(json.loads(payload["options"])["training_set"])[0]
    else:
        try:
            length, energy = metatrain_units(path, target)
        except Exception:  # noqa: BLE001 - not a metatrain model either (or no metatrain): no defaults
            return {}
        out = {}
        for name, unit, known in (
            ("length_unit", length, length_unit_factor),
            ("energy_unit", energy, energy_unit_factor),
        ):
            try:
                if unit:
                    known(unit)  # a unit petfunc's readers know
                    out[name] = unit
            except ValueError:
                pass
        return out
    energy = section["targets"]["energy"]
    out = {
        "energy_key": energy.get("key"),
        "energy_unit": energy.get("unit"),
        "length_unit": section["systems"].get("length_unit"),
    }
    for name in ("forces", "stress", "virial"):
        value = energy.get(name)
        if isinstance(value, Mapping) and value.get("key"):
            out[f"{name}_key"] = value["key"]
    return {k: v for k, v in out.items() if v}


def evaluate(
    model_path,
    dataset_path,
    batch_size: int = 16,
    dtype: torch.dtype | None = None,
    device=None,
    which: str = "best",
    output=None,
    target: str | None = None,
    **label_options,
) -> tuple[dict[str, float], dict]:
    """Errors of a saved model on an extxyz file: ``(metrics, predictions)`` (see
    :func:`error_metrics`, :func:`predict`). ``which`` picks a training checkpoint's
    best or last parameters; ``label_options`` go to :func:`read_labelled`;
    ``output``: also write every structure's predictions there
    (:func:`write_predictions`; then the file may hold no labels, and the metrics
    only the counts); ``target``: see :func:`load_model`."""
    device = None if device is None else resolve_device(device)
    config, params = load_model(model_path, dtype=dtype, which=which, device=device, target=target)
    samples = read_labelled(dataset_path, config, require_labels=output is None, **label_options)
    if output is None:
        pred = predict(config, params, samples, batch_size=batch_size)
    else:
        # one pass (with the stress of every periodic cell) serves the errors and the file
        evaluated = list(_evaluate_structures(config, params, samples, batch_size, stress=True))
        pred = _error_arrays(evaluated)
        _write_results(evaluated, output, label_options.get("energy_unit"), label_options.get("length_unit"))
    metrics = error_metrics(pred)
    metrics["n_structures"] = len(samples)
    metrics["n_atoms"] = int(np.sum(pred["n_atoms"]))
    return metrics, pred
