"""The batches of a run: which structures each step of each epoch takes, on this
process, built into :class:`petfunc.data.Batch` (see :func:`petfunc.data.batch_plan`:
every process draws the same permutation, seeded by ``seed`` and the epoch, cuts it
into the one-process batches of ``batch_size * world_size`` and takes its share of
each)."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.data import Batch, Sample, batch_plan, derived_seed, make_batch, pack_by_atoms, random_rotations


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


@dataclass(frozen=True)
class Batches:
    """The training and validation batches of one process of a run.

    Attributes:
        train, val: the samples.
        config, composition, scale: the model, and the baseline the labels are
            reduced by (training units).
        batch_size: structures per batch and process.
        seed, augment: the run's seed; random rotations of training structures.
        dtype, device: of the batches.
        rank, world_size: this process's share of every batch.
        train_groups, val_groups: structures per file (every batch from one file).
        max_atoms, min_atoms: packing by atom count (``max_atoms`` ``None``: none).
    """

    train: Sequence[Sample]
    val: Sequence[Sample]
    config: PETConfig
    composition: np.ndarray
    scale: float
    batch_size: int
    seed: int
    augment: bool
    dtype: torch.dtype
    device: torch.device
    rank: int
    world_size: int
    train_groups: Sequence[int]
    val_groups: Sequence[int]
    max_atoms: int | None
    min_atoms: int

    def training(self, epoch: int) -> Iterator[tuple[np.ndarray, Batch]]:
        """``(indices, batch)`` of this process's training steps of ``epoch`` (0-based):
        shuffled, the last partial batch of each file dropped, augmented."""
        return iterate_batches(
            self.train,
            self.config,
            self.composition,
            self.scale,
            self.batch_size,
            epoch=epoch,
            seed=self.seed,
            shuffle=True,
            drop_last=True,
            augment=self.augment,
            dtype=self.dtype,
            device=self.device,
            rank=self.rank,
            world_size=self.world_size,
            groups=self.train_groups,
            max_atoms=self.max_atoms,
            min_atoms=self.min_atoms,
        )

    def validation(self) -> list[Batch]:
        """This process's validation batches: every validation structure once, on one
        process (a process may get none)."""
        return [
            b
            for _, b in iterate_batches(
                self.val,
                self.config,
                self.composition,
                self.scale,
                self.batch_size,
                shuffle=False,
                drop_last=False,
                augment=False,
                dtype=self.dtype,
                device=self.device,
                rank=self.rank,
                world_size=self.world_size,
                even_shards=False,
                groups=self.val_groups,
                max_atoms=self.max_atoms,
            )
        ]

    def steps_per_epoch(self) -> int:
        """Training steps per epoch of this process (every epoch takes as many)."""
        return len(
            batch_plan(
                len(self.train),
                self.batch_size,
                0,
                self.seed,
                True,
                True,
                self.rank,
                self.world_size,
                groups=self.train_groups,
                atom_counts=[len(s) for s in self.train],
                max_atoms=self.max_atoms,
                min_atoms=self.min_atoms,
            )
        )


def check_batches(batches: Batches, log: Callable[[str], None]) -> int:
    """The steps per epoch of ``batches``; an error when there are none, and warnings
    for structures no step takes (too many atoms for ``max_atoms``, files too small
    to share among the processes) or batches smaller than asked."""
    train, world_size, max_atoms = batches.train, batches.world_size, batches.max_atoms
    steps_per_epoch = batches.steps_per_epoch()
    if max_atoms is not None:
        oversized = sum(len(s) > max_atoms for s in train)
        if oversized:
            log(
                f"warning: {oversized} training structure(s) have more than "
                f"max_atoms_per_batch = {max_atoms} atoms and are skipped (as in metatrain)"
            )
        if steps_per_epoch == 0:
            raise ValueError(
                f"max_atoms_per_batch = {max_atoms}, min_atoms_per_batch = {batches.min_atoms}: "
                "no training batch is left"
                + (f" for each of the {world_size} processes" if world_size > 1 else "")
            )
        if world_size > 1:
            _packing_notes(batches, log)
    elif world_size > 1:
        # a file's global batch is shared by the processes: one with fewer training
        # structures than processes cannot be
        small = [
            (k, size) for k, size in enumerate(batches.train_groups or [len(train)]) if 0 < size < world_size
        ]
        if small and steps_per_epoch > 0:
            log(
                "warning: "
                + ", ".join(f"training file {k + 1} has {size} structure(s)" for k, size in small)
                + f", fewer than the {world_size} processes: not trained on"
            )
        if steps_per_epoch == 0:
            raise ValueError(
                f"{len(train)} training structure(s) cannot be shared by {world_size} processes: every "
                "process needs at least one structure of every batch; use fewer processes or more data"
            )
    if steps_per_epoch == 0:
        raise ValueError(f"no training batch: the training set has {len(train)} structures")
    if batches.batch_size * world_size > len(train):
        # metatrain refuses this; one smaller batch per epoch is what it would mean
        log(
            f"warning: batch_size {batches.batch_size}"
            + (f" x {world_size} processes" if world_size > 1 else "")
            + f" is more than the {len(train)} training structures: the batches are smaller "
            f"({steps_per_epoch} step(s) per epoch)"
        )
    return steps_per_epoch


def _packing_notes(batches: Batches, log: Callable[[str], None]) -> None:
    """Warn of the packed batches that sit out an epoch: each process takes whole
    packed batches, as many as the others (as metatrain's sampler), so a file's last
    (count mod N) batches sit out an epoch."""
    world_size, notes, start = batches.world_size, [], 0
    for k, size in enumerate(batches.train_groups or [len(batches.train)]):
        counts = [len(s) for s in batches.train[start : start + size]]
        packed = len(pack_by_atoms(counts, batches.max_atoms, batches.min_atoms))
        start += size
        if packed % world_size:
            notes.append(
                f"training file {k + 1}: "
                + (
                    f"its {packed} packed batch(es) are fewer than the {world_size} processes: not trained on"
                    if packed < world_size
                    else f"{packed % world_size} of its {packed} packed batches sit out each epoch "
                    "(different ones each epoch)"
                )
            )
    if notes:
        log("warning: max_atoms_per_batch with several processes: " + "; ".join(notes))
