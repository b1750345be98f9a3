"""A dataset: labelled samples of one config, read from a file, with batching helpers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.data.baselines import fit_composition, fit_scale
from petfunc.data.read import read_frames
from petfunc.data.samples import Batch, Sample, make_batch, random_rotations, sample_from_atoms


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
