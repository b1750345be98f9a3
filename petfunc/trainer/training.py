"""The training loop of ``petfunc train`` as a library function: ``fit(options)``.

``options`` is a metatrain-style options mapping (see :mod:`petfunc.cli` for the
schema and :func:`petfunc.trainer.options.resolve_options`). :func:`fit`

1. reads the training (validation, test) extxyz files with ASE, splits them as
   ``mtt train`` does (:mod:`petfunc.data.read`) and builds the neighbour lists once;
2. fits the composition weights and the energy scale on the training set
   (metatrain's ``CompositionModel`` and ``Scaler``) and stores them in the
   parameters (``composition_weights``, ``energy_scale``, never trained);
3. trains with metatrain's recipe: shuffled batches (last partial batch dropped;
   or packed by atom count with ``max_atoms_per_batch``; see :mod:`petfunc.data.batching`),
   random O(3) augmentation, Adam(W) with linear warm-up + cosine decay stepped per
   batch, global gradient-norm clipping;
4. validates every epoch with the same loss (no augmentation, no optimizer), keeps
   the best parameters by ``best_model_metric`` (as metatrain, which also validates
   every epoch; ``log_interval`` only spaces the printed lines), and writes
   ``last.ckpt``, ``best.ckpt``, ``metrics.csv`` and, at the end, ``parity.png``
   and ``best_params.pt`` (a :func:`petfunc.save_params` file);
5. evaluates the best parameters on the test set, if any (log, ``parity_test.png``,
   :attr:`FitResult.test_errors`).

Step structure (the seam for data-parallel training)::

    world_size == 1 and reduce_grads is None:
        state, metrics = train_step(state, batch)              # fused, compiled
    otherwise:
        grads, metrics = grad_step(state.params, batch)         # compiled
        grads = reduce_grads(grads)                             # e.g. all-reduce AVG
        state, _ = apply_gradients(optimizer, state, grads, clip)

:func:`batch_plan` takes ``rank``/``world_size``: every rank draws the same
permutation (seeded by ``seed`` and the epoch), cuts it into the one-process batches
of ``batch_size * world_size`` and takes its share of each. Only rank 0 writes
files. ``reduce_metrics`` (identity by default) is where summed metrics are
all-reduced.

Randomness: all of it (split, shuffling, augmentation, initial parameters) derives
from ``seed`` and the epoch, never from global RNG state or the rank, so a run
restarted from the checkpoint of epoch k continues bit for bit like the
uninterrupted run (same device, same dtype, same number of threads). Two runs with
the same options give the same model: on CPU the training runs by default under
:func:`petfunc.deterministic_algorithms`, so that the parallel float sums of
scatter-adds do not depend on thread timing (option ``deterministic``: ``null``, the
default, means on CPU only; on CUDA the deterministic scatter kernels may cost speed,
which no one has measured here).

Checkpoints (``*.ckpt``) are ``torch.save`` files of plain data (strings, numbers,
lists, dicts and tensors: the torchopt NamedTuple state is stored as nested dicts)
that load with ``torch.load(path, weights_only=True)``, written to a temporary file
and renamed over the old one, so a kill never leaves a half-written checkpoint.
Keys: ``format``, ``format_version``, ``petfunc_version``, ``config`` (JSON),
``params`` ({dotted name: tensor}), ``opt_state``, ``epoch`` (completed epochs),
``step``, ``best_epoch``, ``best_metric``, ``best_params``, ``composition``
({``atomic_types``, ``weights``}), ``energy_scale``, ``dtype``, ``rng`` (seed and
torch's global RNG state), ``options`` (JSON), ``history`` (one dict per epoch),
``split`` (file indices of the training, validation and test structures, per file).
"""

from __future__ import annotations

import csv
import dataclasses
import io as _io
import json
import math
import random
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petfunc import lora, tree
from petfunc._files import atomic_write, remove_leftover_temporaries
from petfunc.config import PETConfig
from petfunc.data import Sample, fit_composition, fit_scale, make_batch, random_rotations
from petfunc.data.batching import batch_plan, derived_seed, pack_by_atoms
from petfunc.data.read import read_labelled
from petfunc.derivatives import energy_and_forces, energy_forces_strain_derivative
from petfunc.determinism import deterministic_algorithms
from petfunc.io.checkpoint import CHECKPOINT_FORMAT, read_checkpoint, state_from_plain, write_checkpoint
from petfunc.io.load import load_model, load_model_and_lora, torch_payload
from petfunc.io.metatrain import metatrain_units, read_metatrain_baseline
from petfunc.io.params import save_params
from petfunc.model.pet import PET
from petfunc.remat import remat
from petfunc.structures import collate
from petfunc.train import (
    LossWeights,
    TrainState,
    apply_gradients,
    make_grad_step,
    make_loss,
    make_optimizer,
    make_train_step,
    pack_state,
    trainable,
    warmup_cosine,
)
from petfunc.trainer.datasets import read_training_files
from petfunc.trainer.options import (
    dataset_sections,
    fixed_composition,
    parse_loss,
    resolve_options,
    trained_parameters,
)


TERMS = ("energy", "forces", "stress")


class TrainingError(RuntimeError):
    """Training cannot continue (a non-finite loss or parameters)."""


@dataclass
class FitResult:
    """What :func:`fit` returns.

    Attributes:
        config: the model architecture.
        params: the best parameters (by ``best_model_metric``), CPU tensors.
        last_params: the parameters after the last epoch, CPU tensors.
        best_epoch: epoch (1-based) of ``params``; 0 if no epoch ran.
        best_metric: the validation metric at ``best_epoch``.
        history: one dict of metrics per epoch (the rows of ``metrics.csv``).
        output_dir: where the files were written (``None`` if nothing was written).
        files: name -> path of the written files.
        compiled_graphs: with ``compile: true``, how many graphs were compiled for
            the ``"train"`` and ``"eval"`` steps (1 each when no batch recompiled).
        test_errors: RMSE and MAE of ``params`` on the ``test_set`` (keys as
            :func:`error_metrics`; empty without a test set, and on ranks other than 0).
    """

    config: PETConfig
    params: Any
    last_params: Any
    best_epoch: int
    best_metric: float
    history: list[dict]
    output_dir: Path | None
    files: dict[str, Path] = field(default_factory=dict)
    compiled_graphs: dict[str, int] = field(default_factory=dict)
    test_errors: dict[str, float] = field(default_factory=dict)


def _write_text(text: str, path: Path) -> None:
    atomic_write(path, lambda handle: handle.write(text), text=True)


# ---------------------------------------------------------------------------------------
# batches


def iterate_batches(
    samples: Sequence[Sample],
    config: PETConfig,
    composition,
    scale: float,
    batch_size: int,
    *,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    augment: bool = False,
    dtype=None,
    device=None,
    rank: int = 0,
    world_size: int = 1,
    even_shards: bool = True,
    groups: Sequence[int] | None = None,
    max_atoms: int | None = None,
    min_atoms: int = 0,
):
    """Yield ``(indices, Batch)`` for one epoch (see :func:`batch_plan`).

    Augmentation: one rotation per structure and epoch, drawn for all structures at
    once from a generator seeded by ``(seed, epoch)`` and indexed by the structure,
    so a structure is rotated the same way whichever process or batch takes it, and
    N processes train the model of one process."""
    rotations = None
    if augment:
        generator = torch.Generator().manual_seed(derived_seed(seed, epoch, 0xA06))
        rotations = random_rotations(len(samples), generator)
    counts = [len(s) for s in samples] if max_atoms is not None else None
    for idx in batch_plan(
        len(samples),
        batch_size,
        epoch,
        seed,
        shuffle,
        drop_last,
        rank,
        world_size,
        even_shards,
        groups,
        counts,
        max_atoms,
        min_atoms,
    ):
        chosen = [samples[i] for i in idx]
        yield (
            idx,
            make_batch(
                chosen,
                config,
                composition,
                scale,
                dtype,
                device,
                None if rotations is None else rotations[np.asarray(idx)],
            ),
        )


# ---------------------------------------------------------------------------------------
# metrics


class _Sums:
    """Epoch sums of the per-batch metrics: ``loss`` (sum of batch losses),
    ``batch_count`` and ``{term}_sse``/``_sae``/``_count`` for the active ``terms``.

    The keys are fixed by ``terms``, so every rank holds the same keys even when it
    evaluated no batch, and every value is a sum: the ``reduce_metrics`` hook
    all-reduces them with SUM and :meth:`summary` gives the global means.

    With ``weights`` (validation) the summary's ``loss`` is the loss of all the
    structures seen as one batch (from the per-term sums ``{term}_lsum`` of the
    elementwise losses), which does not depend on how they were batched or on the
    number of processes; without, it is the mean of the batch losses (training,
    where each step's loss is that of its whole global batch).
    """

    def __init__(self, terms: Sequence[str], weights: LossWeights | None = None):
        self.terms = tuple(terms)
        self.weights = weights
        self.values: dict[str, float] = {"loss": 0.0, "batch_count": 0.0}
        for term in self.terms:
            for kind in ("sse", "sae", "count") + (("lsum",) if weights is not None else ()):
                self.values[f"{term}_{kind}"] = 0.0

    def add(self, metrics: dict[str, float]):
        self.values["batch_count"] += 1.0
        for key in self.values:
            if key in metrics:
                self.values[key] += metrics[key]
        if self.weights is not None:
            for term in self.terms:
                loss = metrics[f"{term}_loss"]
                if getattr(self.weights, term).reduction == "mean":
                    loss = loss * metrics[f"{term}_count"]
                self.values[f"{term}_lsum"] += loss

    def _pooled_loss(self) -> float:
        loss = 0.0
        for term in self.terms:
            spec = getattr(self.weights, term)
            total, count = self.values[f"{term}_lsum"], self.values[f"{term}_count"]
            if spec.reduction == "mean":
                total = total / count if count > 0 else 0.0
            loss += spec.weight * total
        return loss

    def summary(self, scale: float) -> dict[str, float]:
        batches = self.values["batch_count"]
        if batches <= 0:
            loss = math.nan
        elif self.weights is not None:
            loss = self._pooled_loss()
        else:
            loss = self.values["loss"] / batches
        out = {"loss": loss}
        for term in self.terms:
            count = self.values[f"{term}_count"]
            if count > 0:
                out[f"{term}_rmse"] = math.sqrt(self.values[f"{term}_sse"] / count) * scale
                out[f"{term}_mae"] = self.values[f"{term}_sae"] / count * scale
            else:
                out[f"{term}_rmse"] = math.nan
                out[f"{term}_mae"] = math.nan
        return out


def _floats(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    keys = list(metrics)
    values = torch.stack([metrics[k].detach().reshape(()).to(torch.float64) for k in keys]).tolist()
    return dict(zip(keys, values))


def selected_metric(summary: Mapping[str, float], name: str, terms: Sequence[str]) -> float:
    """metatrain's best-model metrics: ``loss``, or the product of the MAEs (RMSEs) of
    the active terms (energy per atom, forces, stress), skipping unlabelled ones."""
    if name == "loss":
        return summary["loss"]
    kind = "mae" if name == "mae_prod" else "rmse"
    value = 1.0
    for term in terms:
        x = summary.get(f"{term}_{kind}", math.nan)
        if not math.isnan(x):
            value *= x
    return value


def _all_finite(params) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tree.flatten(params).values())


# ---------------------------------------------------------------------------------------
# prediction and evaluation (eV units)


def _evaluate_structures(config: PETConfig, params, samples: Sequence[Sample], batch_size: int, stress: bool):
    """Yield ``(sample, energy, forces, strain_derivative)`` for every sample (eV, eV/Å,
    eV; the strain derivative ``None`` without ``stress`` and for structures that are
    not periodic in all three directions, whose stress is undefined), in batches."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    model = PET(config)
    leaves = tree.flatten(params)
    dtype = next(v.dtype for k, v in leaves.items() if k not in ("composition_weights", "energy_scale"))
    device = next(iter(leaves.values())).device
    fn = (energy_forces_strain_derivative if stress else energy_and_forces)(model.energy, "autograd")
    for start in range(0, len(samples), batch_size):
        chunk = list(samples[start : start + batch_size])
        positions, cell, neighbors = collate([s.structure for s in chunk], config, dtype=dtype, device=device)
        result = fn(params, positions, cell, neighbors)
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
    import ase
    import ase.io
    from ase.calculators.singlepoint import SinglePointCalculator

    from petfunc.ase import voigt
    from petfunc.units import energy_unit_factor, length_unit_factor

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
    text = _io.StringIO()
    ase.io.write(text, frames, format="extxyz")
    _write_text(text.getvalue(), path)
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
    buffer = _io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, lambda handle: handle.write(buffer.getvalue()))


def training_label_options(path, target: str | None = None) -> dict[str, Any]:
    """Label keys and units of the first training file of a petfunc training
    checkpoint's options (``energy_key``, ``forces_key``, ``stress_key``,
    ``virial_key``, ``energy_unit``, ``length_unit``; only those the options set);
    for a metatrain checkpoint or exported model, the units of its training data
    (what ``mtt eval`` reads a file without units in); else ``{}``."""
    from petfunc.trainer.options import dataset_sections
    from petfunc.units import energy_unit_factor, length_unit_factor

    payload, _ = torch_payload(path)  # None: a metatrain model, or no model at all
    if isinstance(payload, dict):  # petfunc's own files; only a training checkpoint has options
        if payload.get("format") != CHECKPOINT_FORMAT:
            return {}
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


# ---------------------------------------------------------------------------------------
# fit


def _default_log(message: str) -> None:
    from tqdm import tqdm

    tqdm.write(message, file=sys.stdout)


def _absolute_paths(options: dict) -> dict:
    for name in ("training_set", "validation_set", "test_set"):
        value = options.get(name)
        for section in value if isinstance(value, list) else [value]:
            if isinstance(section, dict) and "systems" in section:  # (not metatrain's indices-only form)
                section["systems"]["read_from"] = str(
                    Path(section["systems"]["read_from"]).expanduser().resolve()
                )
    training = options["architecture"]["training"]
    finetune = training["finetune"]
    if finetune.get("read_from"):
        finetune["read_from"] = str(Path(finetune["read_from"]).expanduser().resolve())
    for key in ("atomic_baseline", "fixed_scaling_weights"):  # metatrain checkpoints
        if "file" in training[key]:
            training[key]["file"] = str(Path(training[key]["file"]).expanduser().resolve())
    return options


def _baseline_file(path, kind, atomic_types, unit, additive_models=("CompositionModel",)):
    """:func:`petfunc.io.read_metatrain_baseline`, with a missing metatrain an options error."""
    try:
        return read_metatrain_baseline(path, kind, atomic_types, unit, additive_models)
    except ImportError as error:
        option = "atomic_baseline" if kind == "composition" else "fixed_scaling_weights"
        raise ValueError(
            f"option 'architecture.training.{option}' names a metatrain {kind} checkpoint: {error}"
        ) from None


def check_model_section(model_hypers: Mapping, config: PETConfig, what: str) -> None:
    """Raise unless every hyperparameter the options name equals ``config``'s.

    As metatrain's ``raise_if_hypers_mismatch`` on restart and fine-tuning, only the
    keys given are compared (a nested section such as ``long_range`` is filled with
    its defaults first); the architecture itself comes from the checkpoint.
    """
    if model_hypers.get("atomic_types") is not None:
        added = sorted(set(int(z) for z in model_hypers["atomic_types"]) - set(config.atomic_types))
        if added:  # they were ignored; metatrain refuses new types
            raise ValueError(
                f"option 'architecture.atomic_types' has type(s) {added} that the model of {what} "
                f"lacks (it has {list(config.atomic_types)}); a PET model cannot add atomic types"
            )
    given = {k: v for k, v in model_hypers.items() if k != "atomic_types"}
    if not given:
        return
    try:
        merged = PETConfig.from_hypers({**config.to_hypers(), **given})
    except ValueError as error:
        raise ValueError(f"option 'architecture.model': {error}") from None
    diff = [
        f"{k}: {getattr(merged, k)!r} here, {getattr(config, k)!r} in it"
        for k in given
        if getattr(merged, k) != getattr(config, k)
    ]
    if diff:
        raise ValueError(
            f"option 'architecture.model' differs from the architecture of {what} ("
            + "; ".join(diff)
            + "); remove these keys or make them match"
        )


def _baseline_from_files(options, config: PETConfig):
    """``(composition weights, energy scale)`` read from metatrain's composition and
    scaler checkpoints named by ``atomic_baseline: {file}`` and
    ``fixed_scaling_weights: {file}``; each ``None`` when not given. Such files were
    fitted on data in one energy unit, so the training files must share it."""
    training = options["architecture"]["training"]
    baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
    if "file" not in baseline and "file" not in scaler:
        return None, None
    units = {section["targets"]["energy"]["unit"] for section in dataset_sections(options["training_set"])}
    if len(units) > 1:
        raise ValueError(
            f"the training files have energies in several units ({sorted(units)}); "
            "a composition or scaler checkpoint needs one"
        )
    (unit,) = units
    composition = scale = None
    if "file" in baseline:
        composition = _baseline_file(baseline["file"], "composition", config.atomic_types, unit)
    if "file" in scaler:
        additive = ("CompositionModel",) + (("ZBL",) if config.zbl else ())
        scale = float(_baseline_file(scaler["file"], "scaler", config.atomic_types, unit, additive))
    return composition, scale


def _finetune_baseline(options, dtype, device, params):
    """``(composition weights, energy scale)`` a fine-tuning run keeps from its
    checkpoint, or ``None`` (no fine-tuning, or a target the checkpoint lacks).

    metatrain fits the composition and the scale only for targets that are new to
    the model: those of the trained target (``energy``, or the dataset's
    ``mtt::NAME``) are kept when the checkpoint has that target, whichever target
    ``inherit_heads`` takes the heads from; otherwise they are fitted."""
    finetune = options["architecture"]["training"]["finetune"]
    path = finetune.get("read_from")
    if not path:
        return None
    name = finetune.get("target_name", "energy")
    source = (finetune.get("inherit_heads") or {}).get("energy")
    if source is None or source == name:
        weights_of = params  # read from the trained target itself (see _initial_model)
    else:
        weights_of = _target_params(path, name, dtype, device)
        if weights_of is None:
            return None
    return (
        weights_of["composition_weights"].detach().to("cpu", torch.float64).numpy().copy(),
        float(weights_of["energy_scale"]),
    )


def _target_params(path, name: str, dtype, device):
    """The parameters of target ``name`` of a model file, or ``None`` if it has no
    such target."""
    try:
        return load_model_and_lora(path, dtype, "best", device, name, False)[1]
    except ValueError as error:
        if _lacks_target(error):
            return None
        raise


def _lacks_target(error: ValueError) -> bool:
    """Whether ``error`` of :func:`petfunc.io.load.load_model_and_lora` says the file has no such target (a
    metatrain checkpoint without it, or a petfunc file, whose only target is energy)."""
    return "no target" in str(error) or "only target is" in str(error)


def _initial_model(options, model_hypers, atomic_types, dtype, device, seed, log):
    finetune_options = options["architecture"]["training"]["finetune"]
    finetune = finetune_options.get("read_from")
    if finetune:
        # metatrain's inherit_heads {energy: SOURCE}: the energy heads start from the
        # source target's heads
        source = (finetune_options.get("inherit_heads") or {}).get("energy")
        name = finetune_options.get("target_name", "energy")
        # metatrain fine-tunes the checkpoint's target of the dataset's name, or
        # starts new heads for a target it lacks
        by_name = source is None and name != "energy"
        if by_name:
            source = name
        # method 'lora' on a model fine-tuned with LoRA trains its adapters on, as
        # metatrain does (it injects no new ones); other methods merge them
        continue_lora = finetune_options.get("method") == "lora"
        try:
            config, params, source_lora = load_model_and_lora(
                finetune, dtype, "best", device, source, continue_lora
            )
        except ValueError as error:
            if by_name and _lacks_target(error):
                raise ValueError(
                    f"the fine-tuning checkpoint {finetune!r} has no target {name!r}: metatrain would start new "
                    f"heads for it, petfunc starts from one of the checkpoint's: name it with "
                    f"'architecture.training.finetune.inherit_heads: {{energy: SOURCE}}'"
                ) from None
            if source is None and "pass target=" in str(error):
                raise ValueError(
                    str(error).replace(
                        "pass target=...",
                        "choose one with 'architecture.training.finetune.inherit_heads: {energy: NAME}'",
                    )
                ) from None
            raise
        check_model_section(model_hypers, config, f"the fine-tuning checkpoint {finetune!r}")
        log(
            f"fine-tuning from {finetune} ({len(config.atomic_types)} atomic types {config.atomic_types})"
            + (f", heads of its target {source!r}" if source else "")
        )
        if source_lora is not None:
            given = finetune_options.get("config") or {}
            effective = {
                "rank": source_lora["rank"],
                "alpha": source_lora["alpha"],
                "target_modules": list(source_lora["targets"]),
            }
            if any(given.get(k, effective[k]) != effective[k] for k in effective):
                log(
                    f"the model already has LoRA adapters: training them on (rank {effective['rank']}, alpha "
                    f"{effective['alpha']:g}) as metatrain does, instead of finetune.config {given}"
                )
            finetune_options["config"] = effective  # stored in checkpoints: a restart agrees
        return config, params
    hypers = dict(model_hypers)
    hypers.setdefault("atomic_types", atomic_types)
    try:  # the options checked each value; here the relations between them (d_pet, num_heads, ...)
        config = PETConfig.from_hypers(hypers)
    except ValueError as error:
        raise ValueError(f"option 'architecture.model': {error}") from None
    params = PET(config).init(seed=seed, dtype=dtype, device=device)
    return config, params


def fit(
    options: Mapping | None,
    output_dir=None,
    *,
    restart=None,
    progress: bool | None = None,
    log: Callable[[str], None] | None = None,
    reduce_grads: Callable | None = None,
    reduce_metrics: Callable | None = None,
    rank: int = 0,
    world_size: int = 1,
) -> FitResult:
    """Train a PET model (see the module docstring).

    Args:
        options: a metatrain-style options mapping (:func:`petfunc.trainer.options.resolve_options`
            is applied; already resolved options are accepted too).
        output_dir: folder for checkpoints, ``metrics.csv`` and ``parity.png``
            (created). ``None``: the restart checkpoint's folder, else nothing is
            written.
        restart: a ``last.ckpt``/``best.ckpt`` to continue from: parameters, optimizer
            state, epoch, composition and scale are restored; the run then continues
            exactly as the uninterrupted one would. ``options`` still apply (e.g. more
            epochs; the learning-rate schedule then changes), the architecture is the
            checkpoint's.
        progress: show a tqdm bar (``None``: only on a terminal).
        log: where to write progress lines (default: stdout, bar-safe).
        reduce_grads: data-parallel hook ``grads -> grads`` applied between the
            gradient step and the optimizer step (e.g. an all-reduce average). When
            given, or when ``world_size > 1``, the step is split into ``grad_step`` +
            ``reduce_grads`` + ``apply_gradients``; otherwise one fused ``train_step``.
        reduce_metrics: hook ``{name: float sum} -> {name: float sum}`` for the summed
            epoch metrics (all-reduce SUM in data-parallel training).
        rank, world_size: this process's shard of every batch plan; only rank 0 writes.

    Returns:
        a :class:`FitResult`.

    Raises:
        ValueError / FileNotFoundError: bad options or data (before training starts).
        TrainingError: the loss or the parameters became NaN/inf; the message names
            the epoch and step; checkpoints written before stay intact.
    """
    log = log or _default_log
    if (
        isinstance(world_size, bool)
        or not isinstance(world_size, int)
        or world_size < 1
        or not isinstance(rank, int)
        or not 0 <= rank < world_size
    ):
        raise ValueError(f"fit(rank={rank!r}, world_size={world_size!r}): need 0 <= rank < world_size")
    reduce_metrics = _check_processes(rank, world_size, reduce_grads, reduce_metrics)
    reduce_metrics = reduce_metrics or (lambda sums: sums)
    ckpt = None
    if restart is not None:
        ckpt = read_checkpoint(restart)
        if output_dir is None:
            output_dir = Path(restart).resolve().parent
        if options is None:
            options = json.loads(ckpt["options"])
    if options is None:
        raise ValueError("fit() needs options (or a restart checkpoint that holds them)")
    options = _absolute_paths(resolve_options(options))
    if options["architecture"]["training"]["distributed"] and world_size <= 1:
        raise ValueError(
            "option 'architecture.training.distributed' is true, but this is one process: petfunc "
            "trains on several when started by torchrun (torchrun --nproc-per-node N -m petfunc train "
            "...; see the README's Multi-process section)"
        )
    if ckpt is not None and options["architecture"]["training"]["num_epochs"] < int(ckpt["epoch"]):
        raise ValueError(
            f"the restart checkpoint is at epoch {int(ckpt['epoch'])} and num_epochs is "
            f"{options['architecture']['training']['num_epochs']}: ask for at least as many epochs "
            "(--epochs N, or architecture.training.num_epochs)"
        )
    if ckpt is not None and options["architecture"]["training"]["num_epochs"] == int(ckpt["epoch"]):
        # a run killed after its last epoch's checkpoint: finish it (the best
        # parameters file, the plots, the test set); nothing is trained
        log(
            f"the restart checkpoint is at the last epoch ({int(ckpt['epoch'])}): nothing to train, writing "
            "the end-of-run files (ask for more epochs with --epochs N)"
        )
    if ckpt is not None:
        _check_restart_finetune(
            json.loads(ckpt["options"])["architecture"]["training"]["finetune"],
            options["architecture"]["training"]["finetune"],
            restart,
            log,
        )
    # fixed-order scatter-adds, so that the same seed gives the same run (determinism.py);
    # by default on CPU only, where it was measured to cost nothing
    deterministic = options["architecture"]["training"]["deterministic"]
    if deterministic is None:
        deterministic = torch.device(options["device"]).type == "cpu"
    with deterministic_algorithms(deterministic):
        return _fit(
            options, output_dir, restart, ckpt, progress, log, reduce_grads, reduce_metrics, rank, world_size
        )


def _same_batches_hint(ckpt: Mapping, batch_size: int, world_size: int) -> str:
    """For a restart with another number of processes: the per-process batch size
    that gives the checkpoint's global batches (checkpoints store their world size
    since the fifty-first stop)."""
    before = ckpt.get("world_size")
    stored = json.loads(ckpt["options"])["architecture"]["training"]["batch_size"]
    if not before or int(before) == world_size:
        return ""
    total = int(before) * int(stored)
    who = f"the checkpoint's {before} process{'es' if int(before) > 1 else ''}"
    if total % world_size:
        return f" ({who} took batches of {total} structures in all)"
    return (
        f" ({who} took batches of {total} structures in all: "
        f"--batch-size {total // world_size} gives the same with {world_size})"
        if total // world_size != batch_size
        else ""
    )


def _effective(options: Mapping) -> dict:
    """``options`` with the defaults that depend on the run filled in (``deterministic:
    null`` means true on the CPU), so that a restart names real changes only."""
    options = json.loads(json.dumps(options))
    training = options["architecture"]["training"]
    if training.get("deterministic") is None:
        training["deterministic"] = torch.device(options.get("device") or "cpu").type == "cpu"
    return options


def _check_processes(rank: int, world_size: int, reduce_grads, reduce_metrics):
    """``fit(rank=, world_size=)`` on a ``torch.distributed`` process group of that
    size, whose metrics it all-reduces unless given a ``reduce_metrics``; without a
    process group only with both hooks (the caller's own communication). Returns
    the ``reduce_metrics`` to use. Without the group each process trained alone on
    its shard of every batch; without the metrics hook each validated its own shard
    and rank 0 picked the best epoch from a part of the validation set."""
    from petfunc.distributed import process as pdist

    info = pdist.current()
    if info.distributed:
        if (info.rank, info.world_size) != (rank, world_size):
            # fit's defaults in a process group: every process trained alone, all
            # writing the same folder
            raise ValueError(
                f"fit(rank={rank}, world_size={world_size}), but this process is rank {info.rank} of a "
                f"process group of {info.world_size}: pass rank={info.rank}, world_size={info.world_size}"
            )
        return reduce_metrics or pdist.all_reduce_metrics
    if world_size == 1:
        return reduce_metrics
    if reduce_grads is None or reduce_metrics is None:
        raise ValueError(
            f"fit(world_size={world_size}) needs a torch.distributed process group of {world_size} processes "
            "(start them with torchrun and call petfunc.distributed.init_from_env() first), or the hooks "
            "reduce_grads and reduce_metrics that exchange the gradients and the epoch metrics"
        )
    return reduce_metrics


def _log_unit_notes(options, log) -> None:
    """Say where the data's units make petfunc's model differ from metatrain's: lengths
    not in Å (petfunc converts them and keeps the architecture's lengths in Å, where
    metatrain trains in the data's unit: its ``cutoff: 4.0`` on data in bohr is 4
    bohr), and ``zbl`` with energies not in eV (metatrain adds no ZBL term then)."""
    from petfunc.units import length_unit_factor

    # the dataset sections written out (a fraction or indices have none)
    sections = {
        name: dataset_sections(options[name])
        for name in ("training_set", "validation_set", "test_set")
        if isinstance(options.get(name), (dict, list))
    }
    units = {
        str(s["systems"].get("length_unit") or "angstrom")
        for part in sections.values()
        for s in part
        if "systems" in s
    }
    other = sorted(u for u in units if length_unit_factor(u) != 1.0)
    if other:
        model = options["architecture"]["model"]
        log(
            f"note: lengths in {', '.join(other)} are converted to Å on reading; the model's lengths "
            f"(cutoff {model.get('cutoff', PETConfig.cutoff):g}, cutoff_width "
            f"{model.get('cutoff_width', PETConfig.cutoff_width):g}) are in Å and forces are compared in eV/Å. "
            "metatrain instead trains in the data's length unit (there these cutoffs would be in "
            f"{other[0]}): the same options give a different model"
        )
    energies = {
        str(s["targets"]["energy"].get("unit") or "eV")
        for name in ("training_set", "validation_set")
        for s in sections.get(name, ())
        if "targets" in s
    }
    if options["architecture"]["model"].get("zbl") and energies - {"eV"}:
        log(
            f"note: energies in {', '.join(sorted(energies - {'eV'}))} are converted to eV on reading, and the model "
            "adds the ZBL repulsion in eV; metatrain's model of such data has no ZBL term (it applies ZBL to a "
            "target in eV only): the same options give a different model"
        )


def _check_restart_finetune(stored: Mapping, given: dict, restart, log) -> None:
    """A restart continues the same fine-tuning. Another method is an error (it
    failed on the optimizer state: "opt_state.mu: keys differ"); LoRA adapters keep
    the checkpoint's rank, alpha and layers, with a note when ``given`` asked for
    others (the adapters stayed, and their scaling alpha / rank took the new numbers,
    which changed the model)."""

    def method_of(finetune):
        if not finetune.get("read_from") and finetune.get("method", "full") == "full":
            return "no fine-tuning"
        return f"fine-tuning method {finetune.get('method', 'full')!r}"

    def heads_of(finetune):
        return dict(finetune.get("config") or {}) if finetune.get("method") == "heads" else None

    if method_of(stored) != method_of(given) or heads_of(stored) != heads_of(given):
        raise ValueError(
            f"the restart checkpoint {str(restart)!r} is of a run with {method_of(stored)}"
            + (f" (config {heads_of(stored)})" if heads_of(stored) is not None else "")
            + f", the options ask for {method_of(given)}"
            + (f" (config {heads_of(given)})" if heads_of(given) is not None else "")
            + ": a restart continues the same run. Give that run's options, or fine-tune anew from its "
            "model with 'architecture.training.finetune.read_from'"
        )
    kept, asked = lora.config_of(stored), lora.config_of(given)
    if kept is not None and kept != asked:
        log(
            f"the restart checkpoint has LoRA adapters of rank {kept['rank']} (alpha {kept['alpha']:g}, layers "
            f"{list(kept['targets'])}): training them on, instead of finetune.config {dict(given.get('config') or {})}"
        )
        given["config"] = {
            "rank": kept["rank"],
            "alpha": kept["alpha"],
            "target_modules": list(kept["targets"]),
        }


def _fit(
    options, output_dir, restart, ckpt, progress, log, reduce_grads, reduce_metrics, rank, world_size
) -> FitResult:
    """The body of :func:`fit`, on resolved options (and the loaded restart checkpoint)."""
    is_main = rank == 0
    training = options["architecture"]["training"]
    seed = options["seed"]
    dtype = torch.float64 if options["base_precision"] == 64 else torch.float32
    device = torch.device(options["device"])
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("option 'device' is 'cuda' but torch sees no CUDA device")
    weights, explicit = parse_loss(training["loss"])
    # metatrain's per_structure_targets: energy (and strain derivative) per structure
    weights = dataclasses.replace(weights, per_atom="energy" not in training["per_structure_targets"])

    # Global RNGs too (metatrain seeds torch, numpy and random); petfunc itself uses
    # only private generators.
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)

    # --- data ----------------------------------------------------------------------
    files = read_training_files(options, weights, explicit, seed, ckpt, log)
    if ckpt is not None:  # after the data: options asking for another split are an error there
        changed = tree.differences(_effective(json.loads(ckpt["options"])), _effective(options))
        if changed:
            log(
                "options changed since the checkpoint, this run takes the new values: "
                + "; ".join(changed)
                + (
                    " (the learning-rate schedule is fitted to end with the new last epoch)"
                    if any(c.startswith("architecture.training.num_epochs") for c in changed)
                    and training["num_epochs"] > int(ckpt["epoch"])
                    else ""
                )
            )
    _log_unit_notes(options, log)
    weights, split_json = files.weights, files.split
    terms = [t for t in TERMS if getattr(weights, t).weight > 0]
    atomic_types = files.atomic_types
    model_hypers = dict(options["architecture"]["model"])
    if ckpt is not None:
        config = PETConfig.from_hypers(json.loads(ckpt["config"]))
        check_model_section(model_hypers, config, f"the restart checkpoint {str(restart)!r}")
        stored = ckpt.get("dtype")
        if stored != str(dtype).replace("torch.", ""):
            raise ValueError(f"the restart checkpoint was trained in {stored}; set base_precision to match")
        params = tree.tree_map(lambda t: t.to(device), tree.unflatten(dict(ckpt["params"])))
    else:
        config, params = _initial_model(options, model_hypers, atomic_types, dtype, device, seed, log)

    train_samples, val_samples = files.samples(config)
    test_samples = files.test_samples(config)
    if ckpt is None and not training["finetune"].get("read_from") and files.validation_only_types:
        log(
            f"warning: atomic type(s) {files.validation_only_types} appear in the validation set only: the model "
            "never trains on them (their composition weight is fitted to 0)"
        )

    # --- composition and scale -----------------------------------------------------------
    finetune_baseline = None if ckpt is not None else _finetune_baseline(options, dtype, device, params)
    if ckpt is not None:
        composition = np.asarray(ckpt["composition"]["weights"], dtype=np.float64)
        scale = float(ckpt["energy_scale"])
    elif finetune_baseline is not None:
        # metatrain's composition model and scaler keep the weights of a target the
        # checkpoint already has (restart: only new targets are fitted); a composition
        # or scaler checkpoint file given in the options replaces them
        baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
        from_file, scale_from_file = _baseline_from_files(options, config)
        composition = finetune_baseline[0] if from_file is None else from_file
        scale = finetune_baseline[1] if scale_from_file is None else scale_from_file
        ignored = [
            name
            for name, value in (("atomic_baseline", baseline), ("fixed_scaling_weights", scaler))
            if value and "file" not in value
        ]
        log(
            "composition weights "
            + (f"from {baseline['file']}" if "file" in baseline else "of the fine-tuning checkpoint")
            + ", energy scale "
            + (f"from {scaler['file']}" if "file" in scaler else "of the fine-tuning checkpoint")
            + " (metatrain keeps a fitted target's)"
            + (f"; {' and '.join(ignored)} given as weights are not used, as in metatrain" if ignored else "")
        )
    else:
        baseline, scaler = training["atomic_baseline"], training["fixed_scaling_weights"]
        fixed, scale_from_file = _baseline_from_files(options, config)
        if fixed is not None:
            log(f"composition weights from {baseline['file']}")
        else:
            fixed = fixed_composition(baseline, config.atomic_types)
        if not any(s.energy is not None and np.isfinite(s.energy) for s in train_samples):
            log(
                "warning: no training structure has a finite energy label: the composition weights are 0 and the "
                "energy scale 1 (nothing to fit them to)"
            )
        if fixed is None:
            # accumulated per batch of each file in turn, as metatrain's loaders do
            composition = fit_composition(
                train_samples,
                config.num_species,
                training["batch_size"],
                config,
                dataset_sizes=files.train_sizes,
            )
        else:
            composition = fixed
        # the scale is fitted only where no fixed one replaces it (the fit evaluates
        # ZBL on every structure, and may warn of a residual at round-off)
        if scale_from_file is not None:
            scale = scale_from_file
            log(f"energy scale from {scaler['file']}")
        elif "energy" in scaler:
            scale = scaler["energy"]
        elif training["scale_targets"]:
            scale = fit_scale(train_samples, composition, config, per_atom=weights.per_atom)
        if not training["scale_targets"]:  # as in metatrain, this wins over a fixed scale
            scale = 1.0
    if ckpt is None:  # a restart's parameters hold them already
        params["composition_weights"] = torch.as_tensor(composition, dtype=torch.float64, device=device)
        params["energy_scale"] = torch.tensor(scale, dtype=torch.float64, device=device)
    # finetune method 'lora': adapters params["lora"] (a restart brings its own), a
    # model that evaluates W + (alpha / rank) B A, and plain weights for the outputs
    lora_config = lora.config_of(training["finetune"])
    if lora_config is not None:
        if lora.KEY not in params:
            params = lora.attach(params, lora_config["rank"], lora_config["targets"], seed=seed)
        model = lora.LoRAPET(config, lora.scaling_of(lora_config["alpha"], params))
        log(
            f"LoRA adapters of rank {lora_config['rank']} (alpha {lora_config['alpha']:g}) on "
            f"{len(lora.target_layers(params, lora_config['targets']))} layers"
        )
    else:
        model = PET(config)

    def plain(p):
        """the model's parameters as a plain PET's (adapters merged)"""
        return lora.merge(p, model.scaling) if lora_config is not None else p

    # >>> petfunc.distributed: every rank reads its own options and data; they must
    # describe one run (another learning rate trained a different model without a
    # word, another batch size aborted in gloo, other epochs hung)
    from petfunc.distributed import check_same_run

    check_same_run(
        {
            **{k: v for k, v in options.items() if k != "device"},  # cuda:LOCAL_RANK differs
            "data": {  # what each rank read (not an option)
                "restart": None if ckpt is None else [int(ckpt["epoch"]), int(ckpt["step"])],
                "structures": [len(train_samples), len(val_samples), len(test_samples)],
                "atoms": int(sum(len(s) for s in train_samples)),
                # to 10 digits: nodes with other CPUs may round the fit differently
                "composition": [float(f"{w:.10g}") for w in composition],
                "energy_scale": float(f"{scale:.10g}"),
                "split": split_json,
            },
        }
    )
    # <<< petfunc.distributed

    # --- optimizer -------------------------------------------------------------------------
    batch_size = training["batch_size"]
    augment = training["augmentation"]
    # every batch comes from one training file, as in metatrain
    train_groups, val_groups = files.train_sizes, files.val_sizes
    max_atoms, min_atoms = training["max_atoms_per_batch"], training["min_atoms_per_batch"]
    packing = {"max_atoms": max_atoms, "min_atoms": min_atoms}
    steps_per_epoch = len(
        batch_plan(
            len(train_samples),
            batch_size,
            0,
            seed,
            True,
            True,
            rank,
            world_size,
            groups=train_groups,
            atom_counts=[len(s) for s in train_samples],
            **packing,
        )
    )
    if max_atoms is not None:
        oversized = sum(len(s) > max_atoms for s in train_samples)
        if oversized:
            log(
                f"warning: {oversized} training structure(s) have more than max_atoms_per_batch = {max_atoms} "
                "atoms and are skipped (as in metatrain)"
            )
        if steps_per_epoch == 0:
            raise ValueError(
                f"max_atoms_per_batch = {max_atoms}, min_atoms_per_batch = {min_atoms}: no training batch is left"
                + (f" for each of the {world_size} processes" if world_size > 1 else "")
            )
        if world_size > 1:
            # each process takes whole packed batches, as many as the others (as
            # metatrain's sampler): a file's last (count mod N) batches sit out an epoch
            notes, start = [], 0
            for k, size in enumerate(train_groups or [len(train_samples)]):
                packed = len(
                    pack_by_atoms([len(s) for s in train_samples[start : start + size]], max_atoms, min_atoms)
                )
                start += size
                if packed % world_size:
                    notes.append(
                        f"training file {k + 1}: "
                        + (
                            f"its {packed} packed batch(es) are fewer than the {world_size} processes: not trained on"
                            if packed < world_size
                            else f"{packed % world_size} of its {packed} packed batches sit out each epoch (different ones each epoch)"
                        )
                    )
            if notes:
                log("warning: max_atoms_per_batch with several processes: " + "; ".join(notes))
    elif world_size > 1:
        # a file's global batch is shared by the processes: one with fewer training
        # structures than processes cannot be
        small = [
            (k, size) for k, size in enumerate(train_groups or [len(train_samples)]) if 0 < size < world_size
        ]
        if small and steps_per_epoch > 0:
            log(
                "warning: "
                + ", ".join(f"training file {k + 1} has {size} structure(s)" for k, size in small)
                + f", fewer than the {world_size} processes: not trained on"
            )
        if steps_per_epoch == 0:
            raise ValueError(
                f"{len(train_samples)} training structure(s) cannot be shared by {world_size} processes: every "
                "process needs at least one structure of every batch; use fewer processes or more data"
            )
    if steps_per_epoch == 0:
        raise ValueError(f"no training batch: the training set has {len(train_samples)} structures")
    if batch_size * world_size > len(train_samples):
        # metatrain refuses this; one smaller batch per epoch is what it would mean
        log(
            f"warning: batch_size {batch_size}"
            + (f" x {world_size} processes" if world_size > 1 else "")
            + f" is more than the {len(train_samples)} training structures: the batches are smaller "
            f"({steps_per_epoch} step(s) per epoch)"
        )
    num_epochs = training["num_epochs"]
    # a restart with another number of processes (or batch packing) may take another
    # number of steps per epoch: the schedule then ends with this run's last epoch
    done_epochs, done_steps = (int(ckpt["epoch"]), int(ckpt["step"])) if ckpt is not None else (0, 0)
    total_steps = max(1, done_steps + max(0, num_epochs - done_epochs) * steps_per_epoch)
    if done_steps != done_epochs * steps_per_epoch:
        log(
            f"warning: the run this restart continues took {done_steps} steps in {done_epochs} epochs, this one "
            f"takes {steps_per_epoch} per epoch (another batch size, number of processes or batch packing): the "
            f"learning-rate schedule is fitted to end with epoch {num_epochs}, so it differs from an "
            "uninterrupted run's" + _same_batches_hint(ckpt, batch_size, world_size)
        )
    schedule = warmup_cosine(training["learning_rate"], total_steps, training["warmup_fraction"])
    optimizer = make_optimizer(schedule, training["weight_decay"])
    clip = training["grad_clip_norm"]
    # finetune methods 'heads' and 'lora': only these parameter paths train, the rest
    # stay as read
    train = trained_parameters(training["finetune"])
    opt_state = optimizer.init(trainable(params, train))
    start_epoch, step = 0, 0
    best_metric, best_epoch, best_params = math.inf, 0, None
    history: list[dict] = []
    if ckpt is not None:
        opt_state = state_from_plain(ckpt["opt_state"], opt_state)
        start_epoch, step = int(ckpt["epoch"]), int(ckpt["step"])
        best_epoch = int(ckpt.get("best_epoch") or 0)
        best_metric = float(ckpt["best_metric"]) if ckpt.get("best_metric") is not None else math.inf
        if ckpt.get("best_params"):
            best_params = tree.tree_map(lambda t: t.to(device), tree.unflatten(dict(ckpt["best_params"])))
        history = [dict(row) for row in ckpt.get("history") or [] if int(row["epoch"]) <= start_epoch]
        # checkpoints before the fifty-first stop named the column best_metric
        history = [
            {("selection_metric" if k == "best_metric" else k): v for k, v in row.items()} for row in history
        ]
    # parameters and moments in one buffer each: whole-vector optimizer steps
    state = pack_state(TrainState(params, opt_state), train)

    # --- step functions -----------------------------------------------------------------
    split = reduce_grads is not None or world_size > 1
    # >>> petfunc.distributed: world_size > 1 without a reduce_grads hook: the exact
    # data-parallel gradient step (global label counts, all-reduced inside the step)
    exact_dp = world_size > 1 and reduce_grads is None
    # <<< petfunc.distributed
    reduce_grads = reduce_grads or (lambda grads: grads)
    compile_on = training["compile"]
    backend = training["compile_backend"]
    # compiled steps are traced torch.func; eager ones use autograd, the same
    # gradient 20-30 % faster (petfunc.derivatives)
    autodiff = "func" if compile_on else "autograd"
    loss_fn = make_loss(model, weights, autodiff)
    # validation reports (and the best-model metric multiplies) every labelled
    # quantity, as metatrain does, also those whose loss weight is 0
    labelled = (
        {"energy"}
        | {"forces" for lab in files.train_labels if lab.forces}
        | {"stress" for lab in files.train_labels if lab.stress or lab.virial}
    )
    val_terms = [t for t in TERMS if t in terms or t in labelled]
    eval_loss_fn = (
        loss_fn if val_terms == terms else make_loss(model, weights, autodiff, metric_terms=val_terms)
    )
    if training["remat"]:  # eager only (options.py); the layers of validation recomputed too
        loss_fn = remat(loss_fn)
        eval_loss_fn = remat(eval_loss_fn)
        if weights.forces.weight or weights.stress.weight:
            log(
                "remat: the force and stress terms differentiate the recomputed layers again, "
                "which keeps their activations: expect little memory saved (it helps energy-only losses)"
            )
    if split:
        raw_step = make_grad_step(model, weights, autodiff, train)
    else:
        raw_step = make_train_step(model, optimizer, weights, clip, autodiff, train)
    # the trace cache key (petfunc.compile) must name everything the traced step bakes
    # in: every option, the architecture, the loss weights and the schedule length
    # (which depends on the data). Any change traces afresh; an identical restart
    # loads the trace.
    trace_key = repr((json.dumps(options, sort_keys=True, default=str), config, weights, total_steps, split))
    # >>> petfunc.distributed
    if exact_dp:
        from petfunc.distributed import DataParallel

        # compiles itself on the first batch
        raw_step = DataParallel(
            model,
            optimizer,
            weights,
            clip,
            compile=compile_on,
            backend=backend,
            metrics="share",
            train=train,
            cache_key=f"fit dp step {trace_key}",
            first_step=step,
        )
    # <<< petfunc.distributed
    if training["remat"]:
        raw_step = remat(raw_step)
    step_fn = None
    eval_fn = None

    def build_step(example):
        if not compile_on or exact_dp:  # exact_dp: petfunc.distributed
            return raw_step
        from petfunc.compile import compile as compile_fn

        log(f"compiling the training step ({backend}); the first call takes a while ...")
        t0 = time.perf_counter()
        args = (state.params, example) if split else (state, example)
        # the fused step overwrites the state it is given (never used again; the
        # state owns its buffers, pack_state copied them): Adam updates in place
        compiled = compile_fn(
            raw_step,
            *args,
            backend=backend,
            cache_key=f"fit step {trace_key}",
            donate_argnums=() if split else (0,),
        )
        log(
            f"{'loaded the cached trace' if compiled.from_cache else 'traced'} in {time.perf_counter() - t0:.1f} s"
        )
        return compiled

    def build_eval(example):
        if not compile_on:
            return eval_loss_fn
        from petfunc.compile import compile as compile_fn

        return compile_fn(
            eval_loss_fn,
            state.params,
            example,
            backend=backend,
            cache_key=f"fit loss {trace_key} {val_terms}",
        )

    # --- files --------------------------------------------------------------------------
    files: dict[str, Path] = {}
    restart_files = None
    if output_dir is not None and is_main:
        output_dir = Path(output_dir)
        output_dir.mkdir(parents=True, exist_ok=True)
        files = {
            "last": output_dir / "last.ckpt",
            "best": output_dir / "best.ckpt",
            "csv": output_dir / "metrics.csv",
            "params": output_dir / "best_params.pt",
            "parity": output_dir / "parity.png",
        }
        # a run killed while writing (SIGKILL, a lost node) leaves its temporary file
        leftovers = remove_leftover_temporaries(
            output_dir, [p.name for p in files.values()] + ["parity_test.png", "epoch_*.ckpt"]
        )
        if leftovers:
            log(f"removed {len(leftovers)} temporary file(s) a killed run left in {output_dir}")
        # a restart's best.ckpt and epoch_N.ckpt are set right once this run has
        # written its last.ckpt (settle_restart below): nothing in the folder is
        # replaced before, so a kill in the first epoch leaves it as it was
        restart_files = None if restart is None else _RestartFiles(Path(restart), ckpt, output_dir)
        same_folder = restart is not None and Path(restart).resolve().parent == output_dir.resolve()
        replaced = [
            name for name in ("last.ckpt", "best.ckpt") if not same_folder and (output_dir / name).exists()
        ]
        if replaced:
            log(
                f"warning: {output_dir} holds the {' and '.join(replaced)} of another run: this run replaces "
                f"them"
                + (
                    ""
                    if restart is not None
                    else f" (to continue that run instead: --restart {output_dir / 'last.ckpt'})"
                )
            )
        numbered = _epoch_files(output_dir)
        later = [name for n, name in sorted(numbered.items()) if not same_folder or n > _start_epoch_of(ckpt)]
        if later:
            log(
                f"warning: {output_dir} holds {', '.join(later)} of "
                + (
                    "later epochs of the run this restart continues, or of another run"
                    if same_folder
                    else "another run"
                )
                + ": they stay until this run writes those epochs"
            )
    elif not is_main:
        output_dir = None
    dtype_name = str(dtype).replace("torch.", "")

    def checkpoint(path: Path, current: TrainState, epoch: int):
        if not _all_finite(current.params):
            raise TrainingError(f"refusing to write {path.name}: the parameters are not finite")
        write_checkpoint(
            path,
            config=config,
            params=current.params,
            opt_state=current.opt_state,
            epoch=epoch,
            step=step,
            best_epoch=best_epoch,
            best_metric=best_metric,
            best_params=best_params,
            composition=composition,
            energy_scale=scale,
            dtype=dtype,
            seed=seed,
            options=options,
            history=history,
            split=split_json,
            world_size=world_size,
            version=_version(),
        )

    def write_csv():
        if not history:
            return
        columns = list(history[0])
        for row in history[1:]:
            columns += [c for c in row if c not in columns]
        text = _io.StringIO()
        writer = csv.DictWriter(text, fieldnames=columns, lineterminator="\n")
        writer.writeheader()
        for row in history:
            writer.writerow({k: (f"{v:.8g}" if isinstance(v, float) else v) for k, v in row.items()})
        _write_text(text.getvalue(), files["csv"])

    # --- report ---------------------------------------------------------------------------
    n_params = tree.count(trainable(params, train))
    log(
        f"training set: {len(train_samples)} structures ({sum(len(s) for s in train_samples)} atoms), "
        f"validation set: {len(val_samples)} structures"
        + (f", test set: {len(test_samples)} structures" if test_samples else "")
        + f"; atomic types {list(config.atomic_types)}"
    )
    log(
        "loss terms: "
        + ", ".join(f"{t} ({getattr(weights, t).type}, weight {getattr(weights, t).weight:g})" for t in terms)
        + f"; energy scale {scale:.6g} eV; composition "
        + ", ".join(f"{z}: {w:.6g}" for z, w in zip(config.atomic_types, composition))
        + " eV"
    )
    log(
        f"model: {n_params} trainable parameters"
        + (f" (fine-tuning {', '.join(train)} only)" if train else "")
        + f" ({dtype_name}, {device}); seed {seed}; "
        + (
            f"{steps_per_epoch} steps per epoch, epochs {start_epoch + 1}..{num_epochs}"
            if start_epoch < num_epochs
            else "no epoch left to train"
        )
        + (f", compile {backend}" if compile_on else "")
    )
    if weights.per_atom:
        log(
            "per epoch: loss (training units; training: mean over the steps, validation: of the whole set) "
            "and RMSE of E: energy per atom (eV/atom), F: forces (eV/Å), S: strain derivative per atom V·σ/N (eV/atom)"
        )
    else:
        log(
            "per epoch: loss (training units; training: mean over the steps, validation: of the whole set) "
            "and RMSE of E: energy per structure (eV), "
            "F: forces (eV/Å), S: strain derivative V·σ (eV) (per_structure_targets: [energy])"
        )
    energy_label = "E(eV/atom)" if weights.per_atom else "E(eV)"

    # --- loop -----------------------------------------------------------------------------
    from tqdm import tqdm

    remaining = max(0, num_epochs - start_epoch) * steps_per_epoch
    bar = tqdm(
        total=remaining,
        disable=(not progress) if progress is not None else None,
        unit="step",
        dynamic_ncols=True,
        file=sys.stderr,
        leave=False,
    )
    val_batches = None
    written_epochs = set()  # epoch_N.ckpt files this run wrote

    def settle_restart():
        """After this run's first last.ckpt (or at the end of a restart that trains
        nothing): best.ckpt and the restart epoch's epoch_N.ckpt of the restart."""
        nonlocal restart_files
        if restart_files is not None:
            written_epochs.update(
                restart_files.settle(best_epoch, start_epoch, training["checkpoint_interval"], log)
            )
            restart_files = None

    try:
        for epoch in range(start_epoch, num_epochs):
            t0 = time.perf_counter()
            sums = _Sums(terms)
            batches = iterate_batches(
                train_samples,
                config,
                composition,
                scale,
                batch_size,
                epoch=epoch,
                seed=seed,
                shuffle=True,
                drop_last=True,
                augment=augment,
                dtype=dtype,
                device=device,
                rank=rank,
                world_size=world_size,
                groups=train_groups,
                **packing,
            )
            for idx, batch in batches:
                if step_fn is None:
                    step_fn = build_step(batch)
                if split:
                    grads, metrics = step_fn(state.params, batch)
                    values = _floats(metrics)
                    _check_loss(values["loss"], epoch, step)
                    new_state, norm = apply_gradients(optimizer, state, reduce_grads(grads), clip, train)
                else:
                    new_state, metrics = step_fn(state, batch)
                    values = _floats(metrics)
                    _check_loss(values["loss"], epoch, step)
                state = new_state
                step += 1
                sums.add(values)
                bar.update(1)
                running = sums.summary(scale)
                postfix = {"epoch": epoch + 1, "loss": f"{running['loss']:.4g}"}
                if "energy" in terms:
                    postfix[energy_label] = f"{running['energy_rmse']:.3g}"
                if "forces" in terms:
                    postfix["F(eV/Å)"] = f"{running['forces_rmse']:.3g}"
                bar.set_postfix(postfix, refresh=False)
            sums.values = reduce_metrics(sums.values)
            train_summary = sums.summary(scale)
            if not _all_finite(state.params):
                raise TrainingError(f"epoch {epoch + 1}: the parameters became NaN/inf")
            row = {"epoch": epoch + 1, "step": step, "learning_rate": float(schedule(max(step - 1, 0)))}
            row.update({f"train_{k}": v for k, v in train_summary.items()})

            # every epoch, as metatrain: the best model must not depend on log_interval
            if val_samples:
                if val_batches is None:
                    val_batches = [
                        b
                        for _, b in iterate_batches(
                            val_samples,
                            config,
                            composition,
                            scale,
                            batch_size,
                            shuffle=False,
                            drop_last=False,
                            augment=False,
                            dtype=dtype,
                            device=device,
                            rank=rank,
                            world_size=world_size,
                            even_shards=False,
                            groups=val_groups,
                            max_atoms=max_atoms,
                        )
                    ]
                # every validation structure is evaluated once, on one rank; a
                # rank whose shard is empty contributes zero sums
                if eval_fn is None and val_batches:
                    eval_fn = build_eval(val_batches[0])
                vsums = _Sums(val_terms, weights)
                for batch in val_batches:
                    vsums.add(_floats(eval_fn(state.params, batch)[1]))
                vsums.values = reduce_metrics(vsums.values)
                val_summary = vsums.summary(scale)
                if not math.isfinite(val_summary["loss"]):
                    raise TrainingError(
                        f"epoch {epoch + 1}: the validation loss is {val_summary['loss']}; "
                        "lower the learning rate or check the validation labels"
                    )
                row.update({f"val_{k}": v for k, v in val_summary.items()})
                metric = selected_metric(val_summary, training["best_model_metric"], val_terms)
            else:
                metric = selected_metric(train_summary, training["best_model_metric"], terms)
            row["selection_metric"] = metric  # this epoch's best_model_metric
            improved = metric < best_metric
            if improved:
                best_metric, best_epoch = metric, epoch + 1
                best_params = tree.tree_map(lambda t: t.detach().clone(), state.params)
            row["time_s"] = time.perf_counter() - t0
            history.append(row)
            if files:
                checkpoint(files["last"], state, epoch + 1)
                if improved:
                    checkpoint(files["best"], state, epoch + 1)
                settle_restart()
                if (epoch + 1) % training["checkpoint_interval"] == 0:
                    checkpoint(output_dir / f"epoch_{epoch + 1}.ckpt", state, epoch + 1)
                    written_epochs.add(f"epoch_{epoch + 1}.ckpt")
                write_csv()
            if epoch == start_epoch or (epoch + 1) % training["log_interval"] == 0 or epoch + 1 == num_epochs:
                log(_epoch_line(row, num_epochs, val_terms, improved))
    finally:
        bar.close()

    # --- the end ----------------------------------------------------------------------------
    if best_params is None:
        best_params = state.params
    best_cpu = tree.tree_map(lambda t: t.detach().to("cpu"), plain(best_params))
    last_cpu = tree.tree_map(lambda t: t.detach().to("cpu"), plain(state.params))
    test_errors: dict[str, float] = {}
    if test_samples and is_main:
        test_pred = predict(config, plain(best_params), test_samples, batch_size=batch_size)
        test_errors = error_metrics(test_pred)
        log(
            f"test set ({len(test_samples)} structures), best epoch {best_epoch}, RMSE/MAE: "
            + _errors_line(test_errors)
        )
    if files:
        save_params(files["params"], config, best_cpu)
        eval_samples = val_samples or train_samples
        pred = predict(config, plain(best_params), eval_samples, batch_size=batch_size)
        what = "validation" if val_samples else "training"
        parity_plot(pred, files["parity"], title=f"{what} set, best epoch {best_epoch}")
        if test_samples:
            files["parity_test"] = output_dir / "parity_test.png"
            parity_plot(test_pred, files["parity_test"], title=f"test set, best epoch {best_epoch}")
        log(
            f"best epoch {best_epoch} ({training['best_model_metric']} {best_metric:.4g}); {what} set RMSE/MAE: "
            + _errors_line(error_metrics(pred))
        )
        if restart_files is not None:  # a restart at its last epoch: this run's last.ckpt, then the others
            checkpoint(files["last"], state, start_epoch)
            settle_restart()
        write_csv()  # complete after a restart that trained nothing, too
        written = {p.name for p in files.values() if p.exists()} | written_epochs
        log(f"files of this run in {output_dir}: " + ", ".join(sorted(written)))
    graphs = {
        name: fn.num_graphs
        for name, fn in (("train", step_fn), ("eval", eval_fn))
        if hasattr(fn, "num_graphs")
    }
    return FitResult(
        config, best_cpu, last_cpu, best_epoch, best_metric, history, output_dir, files, graphs, test_errors
    )


def _start_epoch_of(ckpt: Mapping | None) -> int:
    """The epoch a run starts after: its restart checkpoint's, or 0."""
    return 0 if ckpt is None else int(ckpt["epoch"])


class _RestartFiles:
    """What a restart needs to make its output folder agree with its checkpoint,
    read before this run writes anything (it may overwrite the restart file itself).

    ``best.ckpt`` must hold the checkpoint's best epoch while no epoch of this run
    beats it. It may not: a kill between writing ``last.ckpt`` and ``best.ckpt`` of an
    improving epoch, a restart from an earlier checkpoint into a folder that went
    further, a new folder. Its source is the restart checkpoint (when that is the best
    epoch), or the restart folder's ``best.ckpt`` or ``epoch_N.ckpt`` holding that
    epoch; without one, a stale ``best.ckpt`` is removed, with a log line (``--which
    best`` then reads the best parameters from ``last.ckpt``). The restart epoch's
    ``epoch_N.ckpt``, missing (a kill) or another run's, becomes the restart file."""

    def __init__(self, restart: Path, ckpt: Mapping, output_dir: Path):
        self.restart, self.ckpt, self.output_dir = restart, ckpt, output_dir
        self.epoch, self.best_epoch = int(ckpt["epoch"]), int(ckpt.get("best_epoch") or 0)
        self.best_flat = ckpt.get("best_params") or ckpt["params"]
        self.restart_bytes = restart.read_bytes()
        self.best_source = None
        folder = restart.resolve().parent
        for candidate in (restart, folder / "best.ckpt", folder / f"epoch_{self.best_epoch}.ckpt"):
            if (
                self.best_epoch
                and candidate.is_file()
                and self._holds(candidate, self.best_epoch, self.best_flat)
            ):
                self.best_source = (
                    candidate,
                    self.restart_bytes if candidate == restart else candidate.read_bytes(),
                )
                break

    def _holds(self, path: Path, epoch: int, flat) -> bool:
        if path.resolve() == self.restart.resolve():  # holds its own epoch, the best one if that is it
            return self.epoch == epoch
        try:
            other = read_checkpoint(path)
        except (OSError, ValueError):
            return False
        mine = other["params"]
        return (
            int(other.get("epoch", -1)) == epoch
            and mine.keys() == flat.keys()
            and all(torch.equal(mine[k], flat[k]) for k in mine)
        )

    def settle(self, best_epoch: int, start_epoch: int, interval: int, log) -> list[str]:
        """Write or remove ``best.ckpt`` and ``epoch_N.ckpt`` as the docstring says;
        returns the names of the epoch files written."""
        written = []
        best = self.output_dir / "best.ckpt"
        if (
            self.best_epoch
            and best_epoch <= start_epoch
            and not (best.is_file() and self._holds(best, self.best_epoch, self.best_flat))
        ):
            if self.best_source is not None:
                data = self.best_source[1]
                atomic_write(best, lambda handle: handle.write(data))
                log(
                    f"best.ckpt: epoch {self.best_epoch}, the best before this run, copied from {self.best_source[0]}"
                )
            else:
                removed = best.is_file()
                if removed:
                    best.unlink()
                log(
                    ("removed best.ckpt (another epoch's); " if removed else "no best.ckpt: ")
                    + f"the best epoch ({self.best_epoch}) came before this run and its checkpoint is not at hand; "
                    "'--which best' reads its parameters from last.ckpt"
                )
        numbered = self.output_dir / f"epoch_{self.epoch}.ckpt"
        if (
            self.epoch % interval == 0
            and numbered.resolve() != self.restart.resolve()
            and not (numbered.is_file() and self._holds(numbered, self.epoch, self.ckpt["params"]))
        ):
            data = self.restart_bytes
            atomic_write(numbered, lambda handle: handle.write(data))
            written.append(numbered.name)
        return written


def _epoch_files(output_dir: Path) -> dict[int, str]:
    found = {}
    for path in output_dir.glob("epoch_*.ckpt"):
        number = path.name[len("epoch_") : -len(".ckpt")]
        if number.isdigit():
            found[int(number)] = path.name
    return found


def _errors_line(errors: Mapping[str, float]) -> str:
    units = {
        "energy_per_atom": ("energy/atom", "eV/atom"),
        "forces": ("forces", "eV/Å"),
        "stress": ("stress", "eV/Å³"),
    }
    return ", ".join(
        f"{name} {errors[k + '_rmse']:.4g}/{errors[k + '_mae']:.4g} {unit}"
        for k, (name, unit) in units.items()
        if k + "_rmse" in errors
    )


def _version() -> str:
    from petfunc import __version__

    return __version__


def _check_loss(value: float, epoch: int, step: int) -> None:
    if not math.isfinite(value):
        raise TrainingError(
            f"the training loss is {value} at epoch {epoch + 1}, step {step + 1}"
            + (" (the checkpoints of the epochs before are intact)" if epoch else "")
            + ". Lower the learning rate, check the labels for outliers, or train in float64 (base_precision: 64)."
        )


def _epoch_line(row: Mapping, num_epochs: int, terms: Sequence[str], improved: bool) -> str:
    parts = [f"epoch {row['epoch']:>4d}/{num_epochs}"]
    for prefix in ("train", "val"):
        if f"{prefix}_loss" not in row:
            continue
        text = f"{prefix} loss {row[f'{prefix}_loss']:.4g}"
        for term in terms:
            value = row.get(f"{prefix}_{term}_rmse")
            if value is not None and not math.isnan(value):
                text += f" {term[0].upper()} {value:.3g}"
        parts.append(text)
    parts.append(f"lr {row['learning_rate']:.3g}")
    parts.append(f"{row['time_s']:.1f} s" + (" *" if improved else ""))
    return " | ".join(parts)
