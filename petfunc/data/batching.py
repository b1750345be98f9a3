"""Which structures go into which batch, epoch by epoch (indices only, no tensors).

Two rules, both as metatrain's training loaders draw them, with petfunc's own
seeds where metatrain uses torch's global RNG:

* a fixed ``batch_size``: a seeded permutation cut into batches, the last partial
  batch dropped in training;
* ``max_atoms`` (metatrain's ``max_atoms_per_batch``): structures are packed
  greedily into batches of at most ``max_atoms`` atoms, once, in the order of
  numpy's ``default_rng(0)`` permutation (as metatrain's
  ``MaxAtomDistributedBatchSampler``, so the packing is the same in every run and on
  every rank); each epoch presents the batches in the order of
  ``torch.randperm(n_batches)`` seeded by the epoch. In training, a structure with
  more than ``max_atoms`` atoms is skipped, and so is a packed batch with fewer than
  ``min_atoms``; evaluation keeps every structure (an oversized one as a batch of
  its own).

Several files (``groups``) are planned file by file, and their batches shuffled
together: every batch comes from one file, as in metatrain's combined loader.
Data-parallel ranks take interleaved shares of the batches (or of the permutation).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


__all__ = ["batch_plan", "derived_seed", "pack_by_atoms"]


def derived_seed(*parts: int) -> int:
    """A 63-bit seed derived from integers (numpy's ``SeedSequence``)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(1, dtype=np.uint64)[0] >> 1)


def pack_by_atoms(
    atom_counts: Sequence[int],
    max_atoms: int,
    min_atoms: int = 0,
    shuffle: bool = True,
    keep_all: bool = False,
) -> list[np.ndarray]:
    """Greedy packing of structures (with ``atom_counts`` atoms) into batches of at
    most ``max_atoms`` atoms, in the order of ``default_rng(0).permutation`` (or in
    file order without ``shuffle``): a batch takes structures until the next one
    would exceed ``max_atoms``.

    Without ``keep_all`` (training, as metatrain) a structure larger than
    ``max_atoms`` is left out, and so is a batch of fewer than ``min_atoms`` atoms.
    With ``keep_all`` (evaluation) an oversized structure is a batch of its own and
    no batch is left out.
    """
    counts = np.asarray(atom_counts, dtype=np.int64)
    if max_atoms < 1:
        raise ValueError(f"max_atoms_per_batch must be positive, got {max_atoms}")
    if not 0 <= min_atoms <= max_atoms:
        raise ValueError(
            f"min_atoms_per_batch must be in [0, max_atoms_per_batch = {max_atoms}], got {min_atoms}"
        )
    order = np.random.default_rng(0).permutation(len(counts)) if shuffle else np.arange(len(counts))
    batches: list[np.ndarray] = []
    current: list[int] = []
    atoms = 0

    def close():
        if current and (keep_all or atoms >= min_atoms):
            batches.append(np.array(current, dtype=np.int64))

    for i in order:
        n = int(counts[i])
        if n > max_atoms:
            if keep_all:
                close()
                current, atoms = [], 0
                batches.append(np.array([i], dtype=np.int64))
            continue
        if atoms + n > max_atoms:
            close()
            current, atoms = [], 0
        current.append(int(i))
        atoms += n
    close()
    return batches


def batch_plan(
    n: int,
    batch_size: int,
    epoch: int = 0,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = True,
    rank: int = 0,
    world_size: int = 1,
    even_shards: bool = True,
    groups: Sequence[int] | None = None,
    atom_counts: Sequence[int] | None = None,
    max_atoms: int | None = None,
    min_atoms: int = 0,
) -> list[np.ndarray]:
    """Indices of the batches of one epoch for one rank.

    All ranks draw the same permutation (from ``seed`` and ``epoch``). With one
    process it is cut into batches of ``batch_size``, the last partial one dropped
    when ``drop_last`` (unless it is the only one), as metatrain's training loader
    does.

    With ``even_shards`` (training; every step all-reduces gradients, so every rank
    must take the same number of steps) ``batch_size`` is per process: the
    permutation is cut into global batches of ``batch_size * world_size`` by the same
    rule, and rank ``r`` takes ``global_batch[r::world_size]`` of each. The union of
    the ranks' batches of a step is then exactly the one-process batch of
    ``batch_size * world_size``, the lone partial batch of a small file included
    (its shares differ by at most one structure). A global batch with fewer
    structures than processes is left out (a rank would get none).
    ``even_shards=False`` (evaluation, which has no per-batch collectives) gives each
    rank ``perm[rank::world_size]`` cut into batches of ``batch_size``: every
    structure in exactly one shard; shards may differ by one structure, and a rank
    may get none.

    ``max_atoms`` (with ``atom_counts``, one per structure): batches are packed by
    atom count instead (:func:`pack_by_atoms`; ``batch_size`` is not used): the
    packing is fixed, each epoch shuffles the order of the batches, and ranks take
    interleaved batches (with ``even_shards``, as many each). ``drop_last`` is the
    training rule (oversized structures and batches under ``min_atoms`` left out),
    without it every structure is kept.

    ``groups``: the sizes of consecutive blocks of the ``n`` indices (one per dataset
    file, summing to ``n``). As metatrain's combined loader does, every batch then
    comes from one block: each block is planned on its own (its own last partial
    batch dropped), and the order of all the batches is shuffled (kept in block
    order when not ``shuffle``). One block is the plain rule above.
    """
    if atom_counts is not None and len(atom_counts) != n:
        raise ValueError(f"{len(atom_counts)} atom counts for {n} structures")
    shards = (rank, world_size, even_shards)
    if groups is not None and len(groups) > 1:
        if sum(groups) != n:
            raise ValueError(f"groups {list(groups)} do not add up to {n} structures")
        batches, start = [], 0
        for g, size in enumerate(groups):
            counts = None if atom_counts is None else atom_counts[start : start + size]
            plan = batch_plan(
                size, batch_size, epoch, derived_seed(seed, g, 0xF11E), shuffle, drop_last, *shards,
                None, counts, max_atoms, min_atoms,
            )  # fmt: skip
            batches += [b + start for b in plan]
            start += size
        if shuffle:
            order = np.random.default_rng(derived_seed(seed, epoch, 0xBA7C)).permutation(len(batches))
            batches = [batches[i] for i in order]
        return batches
    if max_atoms is not None:
        if atom_counts is None:
            raise ValueError("max_atoms needs the atom_counts of the structures")
        packed = pack_by_atoms(atom_counts, max_atoms, min_atoms, shuffle, keep_all=not drop_last)
        return _packed_plan(packed, epoch, shuffle, *shards)
    return _shuffled_plan(n, batch_size, epoch, seed, shuffle, drop_last, *shards)


def _packed_plan(packed, epoch: int, shuffle: bool, rank: int, world_size: int, even_shards: bool):
    """One rank's batches of an epoch, from the fixed batches ``packed`` by atom count."""
    order = list(range(len(packed)))
    if shuffle:
        order = torch.randperm(len(packed), generator=torch.Generator().manual_seed(epoch)).tolist()
    if world_size > 1:
        if even_shards:
            order = order[: (len(order) // world_size) * world_size]
        order = order[rank::world_size]
    return [packed[i] for i in order]


def _shuffled_plan(n, batch_size, epoch, seed, shuffle, drop_last, rank, world_size, even_shards):
    """One rank's batches of an epoch of ``n`` structures in batches of ``batch_size``."""
    order = np.arange(n)
    if shuffle:
        order = np.random.default_rng(derived_seed(seed, epoch, 0x5EED)).permutation(n)
    if world_size > 1 and even_shards:
        # the one-process batches of batch_size * world_size, each shared by the ranks
        # (for full batches this is perm[rank::world_size] cut into batch_size)
        size = batch_size * world_size
        global_batches = _cut(order, size, drop_last)
        return [b[rank::world_size] for b in global_batches if len(b) >= world_size]
    if world_size > 1:
        order = order[rank::world_size]
    return _cut(order, batch_size, drop_last)


def _cut(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """``order`` in consecutive batches of ``batch_size``; with ``drop_last`` the last
    partial one is dropped unless it is the only one."""
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    if drop_last and len(batches) > 1 and len(batches[-1]) < batch_size:
        batches = batches[:-1]
    return batches
