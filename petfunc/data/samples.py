"""Labelled structures, datasets and training batches.

A :class:`Sample` is a :class:`~petfunc.structures.Structure` with its labels in eV,
eV/Å and eV/Å^3 (NaN or ``None`` where missing). A :class:`Batch` holds the model
inputs plus targets already in *training units*, as metatrain's trainer prepares
them: the composition energy sum_i w_{Z_i} is removed (in float64, so float32
training loses no precision to large totals) and everything is divided by the
energy scale c:

* ``energy``: (E - sum w) / c per structure;
* ``forces``: F / c per atom;
* ``strain_derivative``: dE/d eps / c = V sigma / c (or -W / c from a virial).

With ``PETConfig(zbl=True)`` the ZBL repulsion is an additive model, as in
metatrain (``remove_additive``): its energy, forces and strain derivative
(:func:`zbl_baseline`, float64) are subtracted from the labels before the
composition fit, the scale fit and the division by c, so the network learns only
the rest, and ``model.energy`` adds ZBL back.

Batches whose sizes (structures, atoms, edges, NEF width) could fall below 2 get a
padding structure (a 3-atom triangle with NaN labels, skipped by the loss): sizes 0
and 1 are specialised by ``torch.compile`` and would force a recompilation.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.graph.neighbors import Neighbors
from petfunc.structures import Structure, collate, prepare, state_from_info


class Batch(NamedTuple):
    """Model inputs and training-unit targets of a batch (see module docstring)."""

    positions: torch.Tensor  # [n_atoms, 3]
    cell: torch.Tensor  # [n_structures, 3, 3]
    neighbors: Neighbors
    energy: torch.Tensor  # [n_structures]
    forces: torch.Tensor  # [n_atoms, 3]
    strain_derivative: torch.Tensor  # [n_structures, 3, 3]

    @property
    def n_structures(self) -> int:
        return self.cell.shape[0]

    def to(self, device) -> Batch:
        return Batch(
            self.positions.to(device),
            self.cell.to(device),
            self.neighbors.to(device),
            self.energy.to(device),
            self.forces.to(device),
            self.strain_derivative.to(device),
        )


@dataclass
class Sample:
    """A structure with labels (eV, eV/Å, eV/Å^3); missing labels are ``None``."""

    structure: Structure
    energy: float | None = None
    forces: np.ndarray | None = None  # [n_atoms, 3]
    stress: np.ndarray | None = None  # [3, 3], ASE sign convention
    virial: np.ndarray | None = None  # [3, 3], W = -dE/d eps
    # cache of zbl_baseline: (config, (E, F [n_atoms, 3], dE/d eps [3, 3]))
    _zbl: tuple | None = dataclasses.field(default=None, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.structure)

    def strain_derivative(self) -> np.ndarray:
        """dE/d eps [3, 3] from the stress (times V) or the virial (times -1); NaN if none."""
        if self.stress is not None and not np.isnan(self.stress).all():
            volume = abs(np.linalg.det(self.structure.cell))
            if volume == 0.0:
                raise ValueError("a stress label needs a periodic cell with non-zero volume")
            return np.asarray(self.stress, dtype=np.float64).reshape(3, 3) * volume
        if self.virial is not None:
            return -np.asarray(self.virial, dtype=np.float64).reshape(3, 3)
        return np.full((3, 3), np.nan)


def sample_from_atoms(
    atoms,
    config: PETConfig,
    energy_key: str | None = "energy",
    forces_key: str | None = "forces",
    stress_key: str | None = "stress",
    virial_key: str | None = None,
    energy_unit: float = 1.0,
    length_unit: float = 1.0,
    label: str = "structure",
    charge_key: str | None = None,
    spin_multiplicity_key: str | None = None,
) -> Sample:
    """Read labels from an ``ase.Atoms`` (``info``/``arrays`` or an attached calculator).

    ``energy_unit``/``length_unit`` convert the file's units to eV and Å
    (multiplicative factors). Keys set to ``None`` are not read. For a model with
    ``system_conditioning``, the total charge and spin multiplicity come from
    ``atoms.info[charge_key]`` and ``atoms.info[spin_multiplicity_key]`` (by default
    ``"charge"``, and ``"spin_multiplicity"`` or else ``"spin"``; 0 and 1 if absent).
    """

    def lookup(key):
        if key is None:
            return None
        if key in atoms.info:
            return atoms.info[key]
        if key in atoms.arrays:
            return atoms.arrays[key]
        calc = atoms.calc
        if calc is not None and key in getattr(calc, "results", {}):
            return calc.results[key]
        return None

    structure = prepare(
        atoms.get_atomic_numbers(),
        atoms.get_positions() * length_unit,
        np.asarray(atoms.cell) * length_unit,
        atoms.pbc,
        config,
        label,
        *state_from_info(atoms.info, charge_key, spin_multiplicity_key),
    )
    energy = lookup(energy_key)
    forces = lookup(forces_key)
    stress = lookup(stress_key)
    virial = lookup(virial_key)

    def values(key, value, shapes, what):
        """``value`` as float64 of one of ``shapes``, else an error naming the key"""
        try:
            array = np.asarray(value, dtype=np.float64)
        except (TypeError, ValueError):
            raise ValueError(
                f"{label}: the {what} under the key {key!r} is not a number or array of numbers: {value!r}"
            ) from None
        if array.shape not in shapes:
            raise ValueError(
                f"{label}: the {what} under the key {key!r} has shape {array.shape}, expected "
                + " or ".join(str(s) for s in shapes)
            )
        return array

    if energy is not None:
        energy = float(values(energy_key, energy, [(), (1,)], "energy").reshape(())) * energy_unit
    if stress is not None:
        stress = values(stress_key, stress, [(6,), (3, 3), (9,)], "stress")
    if virial is not None:
        virial = values(virial_key, virial, [(3, 3), (9,)], "virial")
    if forces is not None:
        forces = np.asarray(forces, dtype=np.float64) * energy_unit / length_unit
        if forces.shape != (len(structure), 3):
            raise ValueError(f"{label}: forces have shape {forces.shape}, expected ({len(structure)}, 3)")
    if stress is not None:
        stress = np.asarray(stress, dtype=np.float64)
        if stress.shape == (6,):
            from ase.stress import voigt_6_to_full_3x3_stress

            stress = voigt_6_to_full_3x3_stress(stress)
        stress = stress.reshape(3, 3) * energy_unit / length_unit**3
    if virial is not None:
        virial = np.asarray(virial, dtype=np.float64).reshape(3, 3) * energy_unit
    return Sample(structure, energy, forces, stress, virial)


# ---------------------------------------------------------------------------------------
# the ZBL additive model


def zbl_baseline(sample: Sample, config: PETConfig) -> tuple:
    """``(E, F [n_atoms, 3], dE/d eps [3, 3])`` of the ZBL repulsion of ``sample``
    (eV, eV/Å; float64 numpy), zeros when ``config.zbl`` is off. Computed once per
    sample and cached on it."""
    n = len(sample)
    if not config.zbl:
        return 0.0, np.zeros((n, 3)), np.zeros((3, 3))
    if sample._zbl is None or sample._zbl[0] != config:
        from petfunc.derivatives import energy_forces_strain_derivative
        from petfunc.model import zbl

        positions, cell, neighbors = collate([sample.structure], config, dtype=torch.float64)

        def repulsion(params, x, c, nb):
            return zbl.energy(x, c, nb, config)

        e, f, w = energy_forces_strain_derivative(repulsion, "autograd")({}, positions, cell, neighbors)
        sample._zbl = (config, (float(e[0]), f.numpy().astype(np.float64), w[0].numpy().astype(np.float64)))
    return sample._zbl[1]


def _baseline_energy(sample: Sample, config: PETConfig | None) -> float:
    return zbl_baseline(sample, config)[0] if config is not None and config.zbl else 0.0


# ---------------------------------------------------------------------------------------
# composition and scale (metatrain's CompositionModel and Scaler)


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


# ---------------------------------------------------------------------------------------
# batches


def random_rotations(n: int, generator: torch.Generator) -> np.ndarray:
    """``[n, 3, 3]`` Haar-random rotations, each negated (improper) with probability 1/2."""
    q = torch.randn((n, 4), generator=generator, dtype=torch.float64)
    q = q / q.norm(dim=1, keepdim=True)
    w, x, y, z = q.unbind(1)
    r = torch.stack(
        [
            1 - 2 * (y * y + z * z),
            2 * (x * y - z * w),
            2 * (x * z + y * w),
            2 * (x * y + z * w),
            1 - 2 * (x * x + z * z),
            2 * (y * z - x * w),
            2 * (x * z - y * w),
            2 * (y * z + x * w),
            1 - 2 * (x * x + y * y),
        ],
        dim=1,
    ).reshape(n, 3, 3)
    sign = torch.randint(0, 2, (n,), generator=generator) * 2 - 1
    return (r * sign[:, None, None]).numpy()


_PADDING_CACHE = {}


def padding_sample(config: PETConfig) -> Sample:
    """A 3-atom triangle (side 1 Å, first species) with no labels, for padding."""
    if config not in _PADDING_CACHE:
        positions = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.8, 0.0]])
        numbers = [config.atomic_types[0]] * 3
        _PADDING_CACHE[config] = Sample(prepare(numbers, positions, None, False, config, "padding"))
    return _PADDING_CACHE[config]


def needs_padding(samples: Sequence[Sample]) -> bool:
    """True when a batch of ``samples`` could have a size below 2 (S, N, E or NEF width),
    judged by the flat neighbour lists (see :func:`kept_graph_too_small` for the
    edges PET keeps)."""
    if len(samples) < 2:
        return True
    edges = sum(len(s.structure.centers) for s in samples)
    if edges < 2:
        return True
    width = max((np.bincount(s.structure.centers).max() if len(s.structure.centers) else 0) for s in samples)
    return width < 2


def kept_graph_too_small(graph) -> bool:
    """True when a collated batch keeps fewer than 2 edges, or fewer than 2 in its
    fullest atom (PET's token count and NEF width; :func:`needs_padding` can only
    bound them by the flat list, before the cutoff, adaptive or not, is applied)."""
    return graph.kept_edges.shape[0] < 2 or graph.nef_index.shape[1] < 2


def make_batch(
    samples: Sequence[Sample],
    config: PETConfig,
    composition: Sequence[float],
    scale: float,
    dtype: torch.dtype | None = None,
    device=None,
    rotations: np.ndarray | None = None,
    pad: bool = True,
) -> Batch:
    """Collate labelled samples into a :class:`Batch` in training units.

    Args:
        composition: per-species energies w (eV), in ``config.atomic_types`` order.
        scale: energy scale c (eV).
        rotations: optional ``[n_samples, 3, 3]`` augmentation rotations (row-vector
            convention: x' = x R).
        pad: add :func:`padding_sample` when a size could fall below 2: by
            :func:`needs_padding` before collating, or, when the edges PET keeps
            are fewer than the flat list's, by :func:`kept_graph_too_small` after.
    """
    samples = list(samples)
    if rotations is None:
        rotations = np.broadcast_to(np.eye(3), (len(samples), 3, 3))
    rotations = list(rotations)

    def collated():
        positions = [s.structure.positions @ r for s, r in zip(samples, rotations)]
        cells = [s.structure.cell @ r for s, r in zip(samples, rotations)]
        # long-range models train with Ewald sums, as metatrain does (its batches are
        # shaped alike for any cell, so one compiled graph serves every batch)
        return collate(
            [s.structure for s in samples],
            config,
            dtype=dtype,
            device=device,
            positions=positions,
            cells=cells,
            long_range="ewald",
        )

    padded = pad and needs_padding(samples)
    if padded:
        samples.append(padding_sample(config))
        rotations.append(np.eye(3))
    pos, cell, graph = collated()
    if pad and not padded and kept_graph_too_small(graph):
        # the flat list was large enough, but PET keeps fewer edges (an adaptive
        # cutoff can drop them all)
        samples.append(padding_sample(config))
        rotations.append(np.eye(3))
        pos, cell, graph = collated()
    composition = np.asarray(composition, dtype=np.float64)

    # the ZBL additive model's share of each label (zeros without ZBL); it is
    # rotation-equivariant, so it rotates with the labels
    baselines = [zbl_baseline(s, config) for s in samples]
    energy = np.array(
        [
            (s.energy - composition[s.structure.species].sum() - b[0]) / scale
            if s.energy is not None
            else np.nan
            for s, b in zip(samples, baselines)
        ]
    )
    forces = np.concatenate(
        [
            ((s.forces - b[1]) @ r) / scale if s.forces is not None else np.full((len(s), 3), np.nan)
            for s, r, b in zip(samples, rotations, baselines)
        ]
    )
    strain = np.stack(
        [r.T @ (s.strain_derivative() - b[2]) @ r / scale for s, r, b in zip(samples, rotations, baselines)]
    )

    def t(a):
        return torch.as_tensor(a, dtype=pos.dtype, device=device)

    return Batch(pos, cell, graph, t(energy), t(forces), t(strain))


class Dataset:
    """A list of :class:`Sample` with batching helpers."""

    def __init__(self, samples: Sequence[Sample], config: PETConfig):
        self.samples: list[Sample] = list(samples)
        self.config = config

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return Dataset(self.samples[index], self.config)
        return self.samples[index]

    @property
    def has_forces(self) -> bool:
        return any(s.forces is not None for s in self.samples)

    @property
    def has_stress(self) -> bool:
        return any(s.stress is not None or s.virial is not None for s in self.samples)

    @property
    def has_energy(self) -> bool:
        return any(s.energy is not None for s in self.samples)

    def fit_composition_and_scale(self, batch_size: int = 16):
        """``(composition [n_species], scale)`` fitted on this dataset (metatrain's way,
        accumulating over blocks of ``batch_size``, the training batch size)."""
        w = fit_composition(self.samples, self.config.num_species, batch_size, config=self.config)
        return w, fit_scale(self.samples, w, self.config)

    def batch_indices(self, batch_size: int, shuffle: bool = False, seed: int = 0, drop_last: bool = False):
        order = np.arange(len(self.samples))
        if shuffle:
            order = np.random.default_rng(seed).permutation(len(self.samples))
        batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
        if drop_last and batches and len(batches[-1]) < batch_size and len(batches) > 1:
            batches = batches[:-1]
        return batches

    def batches(
        self,
        batch_size: int,
        composition,
        scale: float,
        dtype=None,
        device=None,
        shuffle: bool = False,
        seed: int = 0,
        drop_last: bool = False,
        augment: bool = False,
    ) -> Iterator[Batch]:
        """Yield training batches (see :func:`make_batch`)."""
        generator = torch.Generator().manual_seed(int(seed))
        for idx in self.batch_indices(batch_size, shuffle, seed, drop_last):
            chosen = [self.samples[i] for i in idx]
            rotations = random_rotations(len(chosen), generator) if augment else None
            yield make_batch(chosen, self.config, composition, scale, dtype, device, rotations)


def read_dataset(
    path,
    config: PETConfig,
    energy_key: str | None = "energy",
    forces_key: str | None = "forces",
    stress_key: str | None = "stress",
    virial_key: str | None = None,
    energy_unit: float = 1.0,
    length_unit: float = 1.0,
    index=":",
) -> Dataset:
    """Read an extxyz (or any ASE-readable) file into a :class:`Dataset`.

    Raises:
        FileNotFoundError / ValueError: unreadable file, or a structure with bad data
            (the message names the file and the structure index).
    """
    from petfunc.data.read import read_frames  # datafiles builds on this module

    frames = read_frames(path, "dataset", index)
    samples = [
        sample_from_atoms(
            atoms,
            config,
            energy_key,
            forces_key,
            stress_key,
            virial_key,
            energy_unit,
            length_unit,
            label=f"{path}: structure {i}",
        )
        for i, atoms in enumerate(frames)
    ]
    return Dataset(samples, config)
