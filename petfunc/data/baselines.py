"""What is fitted on the training set before training: metatrain's composition
weights (``CompositionModel``) and energy scale (``Scaler``).

The network learns ``(E - sum_i w_{Z_i} - E_ZBL) / c``: per-species energies ``w``
fitted by least squares and the scale ``c`` of what they leave, both in eV, stored
in the parameters (``composition_weights``, ``energy_scale``) and never trained.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.data.samples import Sample, zbl_baseline


def _baseline_energy(sample: Sample, config: PETConfig | None) -> float:
    return zbl_baseline(sample, config)[0] if config is not None and config.zbl else 0.0


def composition_counts(samples: Sequence[Sample], n_species: int) -> np.ndarray:
    """``[n_samples, n_species]`` number of atoms of each species."""
    return np.stack([np.bincount(s.structure.species, minlength=n_species) for s in samples]).astype(
        np.float64
    )


def fit_composition(
    samples: Sequence[Sample],
    n_species: int,
    batch_size: int = 16,
    config: PETConfig | None = None,
    dataset_sizes: Sequence[int] | None = None,
) -> np.ndarray:
    """Per-species energies w (eV) by ridge-regularised least squares on total energies.

    Accumulates X^T X and X^T y per block of ``batch_size`` structures in dataset
    order and solves (X^T X + 1e-14 mean(diag) I) w = X^T y, as metatrain does;
    species that never appear get 0. Structures without an energy label are skipped.
    With a ``config`` whose ``zbl`` is on, y is the energy minus its ZBL part.
    ``dataset_sizes`` splits ``samples`` into consecutive datasets whose blocks are
    cut separately (metatrain's loaders batch each dataset on its own).
    """
    sizes = [len(samples)] if dataset_sizes is None else list(dataset_sizes)
    if sum(sizes) != len(samples):
        raise ValueError(f"dataset_sizes {sizes} do not add up to the {len(samples)} samples")
    bounds = np.cumsum([0] + sizes)
    datasets = [
        [s for s in samples[a:b] if s.energy is not None and np.isfinite(s.energy)]
        for a, b in zip(bounds[:-1], bounds[1:])
    ]
    if not any(datasets):
        return np.zeros(n_species)
    xtx = torch.zeros((n_species, n_species), dtype=torch.float64)
    xty = torch.zeros((n_species, 1), dtype=torch.float64)
    for labelled in datasets:
        for start in range(0, len(labelled), batch_size):
            chunk = labelled[start : start + batch_size]
            x = torch.as_tensor(composition_counts(chunk, n_species))
            y = torch.tensor([[s.energy - _baseline_energy(s, config)] for s in chunk], dtype=torch.float64)
            xtx += x.T @ x
            xty += torch.tensordot(x, y, dims=([0], [0]))
    # metatrain's ridge: 1e-14 times the mean diagonal over *all* species (absent ones
    # count as 0), on the full system (an absent species' row gives w = 0 exactly).
    # With collinear compositions (every structure C2H6O) the fit is determined only
    # up to a null-space direction that this ridge fixes, so it must be the same one.
    ridge = 1e-14 * float(torch.diagonal(xtx).abs().mean())
    w = torch.linalg.solve(xtx + ridge * torch.eye(n_species, dtype=torch.float64), xty).reshape(n_species)
    return w.numpy()


def fit_scale(
    samples: Sequence[Sample],
    composition: np.ndarray,
    config: PETConfig | None = None,
    per_atom: bool = True,
) -> float:
    """Energy scale c: the uncentred RMS of the per-atom residual (E - sum w)/N
    (minus the ZBL energy too with a ``config`` whose ``zbl`` is on); of the
    residual itself without ``per_atom`` (metatrain's ``per_structure_targets``).

    When the composition reproduces every energy to round-off (for example no more
    labelled structures than species), the residual is noise of about 1e-16 of the
    energies, and dividing the labels by it would make forces and loss explode
    (a loss of 1e30): the scale is then 1 eV, with a warning."""
    labelled = [s for s in samples if s.energy is not None and np.isfinite(s.energy)]
    if not labelled:
        return 1.0
    divisor = [len(s) if per_atom else 1 for s in labelled]
    baseline = [_baseline_energy(s, config) for s in labelled]
    targets = np.array([(s.energy - b) / d for s, b, d in zip(labelled, baseline, divisor)])
    residuals = np.array(
        [
            (s.energy - composition[s.structure.species].sum() - b) / d
            for s, b, d in zip(labelled, baseline, divisor)
        ]
    )
    scale = float(np.sqrt(np.mean(np.square(residuals))))
    size = float(np.sqrt(np.mean(np.square(targets))))
    if scale <= 1e-10 * size or scale == 0.0:
        if scale > 0.0:
            warnings.warn(
                f"the composition weights reproduce the {len(labelled)} training energies to round-off "
                f"(residual RMS {scale:.3g} eV against energies of {size:.3g} eV); the energy scale is set "
                "to 1 eV instead (add structures of other compositions)",
                stacklevel=2,
            )
        return 1.0
    return scale
