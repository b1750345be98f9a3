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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from ase.stress import voigt_6_to_full_3x3_stress

from petfunc.config import PETConfig
from petfunc.derivatives import energy_forces_strain_derivative
from petfunc.graph import Neighbors
from petfunc.model import zbl
from petfunc.structures import Structure, collate, collate_padded, padding_structure, prepare, state_from_info


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

    structure = prepare(
        atoms.get_atomic_numbers(),
        atoms.get_positions() * length_unit,
        np.asarray(atoms.cell) * length_unit,
        atoms.pbc,
        config,
        label,
        *state_from_info(atoms.info, charge_key, spin_multiplicity_key),
    )
    energy = _label(atoms, energy_key)
    forces = _label(atoms, forces_key)
    stress = _label(atoms, stress_key)
    virial = _label(atoms, virial_key)
    if energy is not None:
        energy = float(_values(label, energy_key, energy, [(), (1,)], "energy").reshape(())) * energy_unit
    if stress is not None:
        stress = _values(label, stress_key, stress, [(6,), (3, 3), (9,)], "stress")
    if virial is not None:
        virial = _values(label, virial_key, virial, [(3, 3), (9,)], "virial")
    if forces is not None:
        forces = np.asarray(forces, dtype=np.float64) * energy_unit / length_unit
        if forces.shape != (len(structure), 3):
            raise ValueError(f"{label}: forces have shape {forces.shape}, expected ({len(structure)}, 3)")
    if stress is not None:
        stress = np.asarray(stress, dtype=np.float64)
        if stress.shape == (6,):
            stress = voigt_6_to_full_3x3_stress(stress)
        stress = stress.reshape(3, 3) * energy_unit / length_unit**3
    if virial is not None:
        virial = np.asarray(virial, dtype=np.float64).reshape(3, 3) * energy_unit
    return Sample(structure, energy, forces, stress, virial)


def _label(atoms, key):
    """The label under ``key`` in ``atoms.info``, ``atoms.arrays`` or the attached
    calculator's results (in that order), or ``None``."""
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


def _values(label: str, key, value, shapes, what: str) -> np.ndarray:
    """``value`` as float64 of one of ``shapes``, else an error naming the key."""
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
        positions, cell, neighbors = collate([sample.structure], config, dtype=torch.float64)

        def repulsion(params, x, c, nb):
            return zbl.energy(x, c, nb, config)

        e, f, w = energy_forces_strain_derivative(repulsion, "autograd")({}, positions, cell, neighbors)
        sample._zbl = (config, (float(e[0]), f.numpy().astype(np.float64), w[0].numpy().astype(np.float64)))
    return sample._zbl[1]


# ---------------------------------------------------------------------------------------
# composition and scale (metatrain's CompositionModel and Scaler)


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


def padding_sample(config: PETConfig) -> Sample:
    """:func:`petfunc.structures.padding_structure` as a sample without labels."""
    return Sample(padding_structure(config))


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
        pad: add :func:`padding_sample` where a size of the batch could fall below 2
            (see :func:`petfunc.structures.collate_padded`).
    """
    samples = list(samples)
    if rotations is None:
        rotations = np.broadcast_to(np.eye(3), (len(samples), 3, 3))
    rotations = list(rotations)

    structures = [s.structure for s in samples]
    options = {"dtype": dtype, "device": device, "long_range": "ewald"}
    # long-range models train with Ewald sums, as metatrain does (its batches are
    # shaped alike for any cell, so one compiled graph serves every batch)
    positions = [s.structure.positions @ r for s, r in zip(samples, rotations)]
    cells = [s.structure.cell @ r for s, r in zip(samples, rotations)]
    if pad:
        pos, cell, graph, padded = collate_padded(structures, config, False, positions, cells, **options)
    else:
        (pos, cell, graph), padded = (
            collate(structures, config, positions=positions, cells=cells, **options),
            False,
        )
    if padded:
        samples.append(padding_sample(config))
        rotations.append(np.eye(3))
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
