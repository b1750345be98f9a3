"""The training loss of metatrain's PET trainer, as a pure function of (params, batch).

With ``E_s`` the network energy in training units (``model.raw_energy``), ``N_s``
the atoms of structure s, and targets from :class:`~petfunc.data.Batch`:

* energy:  ``L_E = mean_s  l(E_s / N_s, E'_s / N_s)``
* forces:  ``L_F = mean_{i,a} l(-dE/dx_ia, F_ia / c)``
* stress:  ``L_S = mean_{s,a,b} l(dE/d eps_sab / N_s, Sigma_sab / (c N_s))``

(without the divisions by N_s when ``per_atom`` is off: metatrain's
``per_structure_targets: [energy]``)

``L = w_E L_E + w_F L_F + w_S L_S`` where each ``l`` is ``mse``, ``mae`` or ``huber``
(torch's ``HuberLoss`` with threshold ``delta``, 1 by default as in metatrain) and
means run over non-NaN targets only (a term with ``reduction="sum"`` sums them
instead, as torch's and metatrain's ``reduction``). Derivatives come from
``torch.func.grad`` inside the loss (or, eagerly, ``torch.autograd.grad`` with
``autodiff="autograd"``), so the parameter gradient of the loss is a grad of a grad.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from numbers import Real

import torch

from petfunc.data import Batch
from petfunc.derivatives import energy_and_forces, energy_forces_strain_derivative


_TYPES = ("mse", "mae", "huber")
_REDUCTIONS = ("mean", "sum")


@dataclass(frozen=True)
class LossTerm:
    """Weight and type (``mse``, ``mae``, ``huber``) of one loss term; ``delta`` is
    the Huber threshold (in training units, as metatrain's), unused by the others;
    ``reduction``: ``"mean"`` or ``"sum"`` over the batch's labelled entries."""

    weight: float = 1.0
    type: str = "mse"
    delta: float = 1.0
    reduction: str = "mean"

    def __post_init__(self):
        if self.type not in _TYPES:
            raise ValueError(f"loss type must be one of {_TYPES}, got {self.type!r}")
        if self.reduction not in _REDUCTIONS:
            raise ValueError(f"loss reduction must be one of {_REDUCTIONS}, got {self.reduction!r}")
        if not self.weight >= 0:
            raise ValueError(f"loss weight must be >= 0, got {self.weight!r}")
        if not self.delta > 0:
            raise ValueError(f"huber delta must be > 0, got {self.delta!r}")


@dataclass(frozen=True)
class LossWeights:
    """Which terms the loss has. A term with weight 0 is not computed at all
    (no forces are differentiated for an energy-only loss). ``per_atom``: compare
    energies and strain derivatives per atom (metatrain's default); ``False`` compares
    them per structure (metatrain's ``per_structure_targets: [energy]``).

    Each term is a :class:`LossTerm`, a number (its weight, with the default ``mse``:
    ``LossWeights(energy=1.0, forces=10.0)``) or a mapping of :class:`LossTerm`'s
    fields (``{"weight": 10.0, "type": "huber"}``); anything else raises ``TypeError``
    here, not at the first step."""

    energy: LossTerm = LossTerm()
    forces: LossTerm = LossTerm()
    stress: LossTerm = LossTerm()
    per_atom: bool = True

    def __post_init__(self):
        for name in ("energy", "forces", "stress"):
            # a frozen dataclass: fields are set once, here, through object
            object.__setattr__(self, name, as_term(getattr(self, name), name))
        if not isinstance(self.per_atom, bool):
            raise TypeError(f"LossWeights: per_atom must be True or False, got {self.per_atom!r}")

    @classmethod
    def make(
        cls, energy=1.0, forces=1.0, stress=1.0, type: str = "mse", per_atom: bool = True
    ) -> LossWeights:
        """Convenience constructor: floats become terms of one ``type``."""

        def term(x):
            return x if isinstance(x, LossTerm) else LossTerm(float(x), type)

        return cls(term(energy), term(forces), term(stress), per_atom)


def as_term(value, name: str = "term") -> LossTerm:
    """``value`` as a :class:`LossTerm`: a term as it is, a number as the weight of an
    ``mse`` term, a mapping as its fields. ``name`` (``"forces"``) is named in errors."""
    if isinstance(value, LossTerm):
        return value
    if isinstance(value, Mapping):
        unknown = sorted(set(value) - {f.name for f in fields(LossTerm)})
        if unknown:
            raise TypeError(
                f"LossWeights: {name} has unknown keys {unknown}; "
                "a term's keys are weight, type, delta, reduction"
            )
        return LossTerm(**value)
    if isinstance(value, Real) and not isinstance(value, bool):
        return LossTerm(float(value))
    if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.dtype.is_complex:
        return LossTerm(float(value))
    raise TypeError(
        f"LossWeights: {name} must be a weight (a number), a LossTerm or a mapping of its fields, "
        f"got {value!r} ({type(value).__name__})"
    )


def _elementwise(term: LossTerm, pred: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    diff = pred - target
    if term.type == "mse":
        return diff * diff
    if term.type == "mae":
        return diff.abs()
    absolute = diff.abs()
    delta = term.delta
    return torch.where(absolute < delta, 0.5 * diff * diff, delta * (absolute - 0.5 * delta))


def _masked(pred: torch.Tensor, target: torch.Tensor):
    valid = ~torch.isnan(target)
    # NaN targets are replaced before subtracting, so no NaN reaches the gradient
    safe_target = torch.where(valid, target, torch.zeros_like(target))
    safe_pred = torch.where(valid, pred, torch.zeros_like(pred))
    return safe_pred, safe_target, valid


def term_loss(term: LossTerm, pred, target):
    """(loss: mean, or sum, over valid entries; sum of squared errors; sum of abs
    errors; count)."""
    pred, target, valid = _masked(pred, target)
    count = valid.sum().to(pred.dtype)
    per_entry = _elementwise(term, pred, target)
    loss = per_entry.sum()
    if term.reduction == "mean":
        loss = loss / count.clamp_min(1.0)
    diff = pred - target
    return loss, (diff * diff).sum(), diff.abs().sum(), count


def atoms_per_structure(weights: LossWeights, energies: torch.Tensor, batch: Batch) -> torch.Tensor:
    """``[n_structures]`` what the energy and strain-derivative terms divide by: the
    atom counts, or ones when ``weights.per_atom`` is off."""
    if not weights.per_atom:
        return torch.ones_like(energies)
    return torch.zeros_like(energies).scatter_add(
        0, batch.neighbors.structure_index, torch.ones_like(batch.positions[:, 0])
    )


def training_energy(energy_fn):
    """The energy function a loss differentiates: a model's training-mode
    ``raw_energy`` (a :class:`~petfunc.PET`, or a model wrapping one, such as
    :class:`petfunc.lora.LoRAPET`), else ``energy_fn`` itself."""
    raw = getattr(energy_fn, "raw_energy", None)
    return raw if callable(raw) else energy_fn


def make_loss(
    energy_fn: Callable,
    weights: LossWeights = LossWeights(),
    autodiff: str = "func",
    metric_terms: Sequence[str] = (),
):
    """``loss_fn(params, batch) -> (loss, metrics)`` for an energy function.

    ``autodiff`` chooses how forces and stress are differentiated (``"func"`` or the
    eager-only ``"autograd"``, see :mod:`petfunc.derivatives`).

    ``energy_fn(params, positions, cell, neighbors)`` must return energies in the
    batch's training units: for PET that is ``model.raw_energy`` (metatrain's
    training-mode output); passing a :class:`~petfunc.PET` picks it.

    ``metrics`` holds tensors: ``loss``, per-term losses, and for each term the sums
    of squared and absolute errors and the count of labels, in training units
    (multiply by the energy scale for eV), so batches can be aggregated exactly.
    ``metric_terms`` (``"forces"``, ``"stress"``) get these metrics even with weight 0
    (metatrain reports, and its best-model metric multiplies, every labelled
    quantity's errors, whatever its loss weight); they add nothing to the loss.
    """
    energy_fn = training_energy(energy_fn)
    use_forces = weights.forces.weight > 0 or "forces" in metric_terms
    use_stress = weights.stress.weight > 0 or "stress" in metric_terms
    if use_stress:
        derivatives = energy_forces_strain_derivative(energy_fn, autodiff)
    elif use_forces:
        derivatives = energy_and_forces(energy_fn, autodiff)
    else:
        derivatives = None

    def loss_fn(params, batch: Batch):
        args = (params, batch.positions, batch.cell, batch.neighbors)
        if derivatives is None:
            energies = energy_fn(*args)
        else:
            out = derivatives(*args)
            energies, forces = out[0], out[1]
        n_atoms = atoms_per_structure(weights, energies, batch)
        metrics: dict[str, torch.Tensor] = {}
        loss = torch.zeros((), dtype=energies.dtype, device=energies.device)

        mean, sse, sae, count = term_loss(weights.energy, energies / n_atoms, batch.energy / n_atoms)
        loss = loss + weights.energy.weight * mean
        metrics.update(energy_loss=mean, energy_sse=sse, energy_sae=sae, energy_count=count)
        if use_forces:
            mean, sse, sae, count = term_loss(weights.forces, forces, batch.forces)
            if weights.forces.weight > 0:
                loss = loss + weights.forces.weight * mean
            metrics.update(forces_loss=mean, forces_sse=sse, forces_sae=sae, forces_count=count)
        if use_stress:
            per_atom = out[2] / n_atoms[:, None, None]
            target = batch.strain_derivative / n_atoms[:, None, None]
            mean, sse, sae, count = term_loss(weights.stress, per_atom, target)
            if weights.stress.weight > 0:
                loss = loss + weights.stress.weight * mean
            metrics.update(stress_loss=mean, stress_sse=sse, stress_sae=sae, stress_count=count)
        metrics["loss"] = loss
        return loss, metrics

    return loss_fn
