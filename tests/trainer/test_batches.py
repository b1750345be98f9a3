"""The batches of a run: packing by atom count, shards of several processes, one
file per batch, rotations that do not depend on the process.
"""

import numpy as np
import pytest
import torch

from petfunc.data import batch_plan
from petfunc.trainer import fit
from tests.helpers.trainer import TINY_MODEL, quiet, tiny_options


def test_max_atoms_per_batch(dataset, tmp_path):
    """Batches packed by atom count: the step count is the packing's (structures of
    32 atoms are skipped with max_atoms_per_batch 30, with a warning), training runs;
    bad values are errors that name the option."""
    import ase.io

    from petfunc.data import split_datasets

    options = tiny_options(dataset, num_epochs=2, max_atoms_per_batch=30)
    lines = []
    result = fit(options, None, progress=False, log=quiet(lines))
    ((train, _, _),) = split_datasets([16], 0.25, seed=3)
    counts = [len(ase.io.read(dataset, int(i))) for i in train]
    steps = len(batch_plan(len(counts), 4, atom_counts=counts, max_atoms=30))
    assert steps > 0 and any(f"{steps} steps per epoch" in line for line in lines), (steps, lines)
    skipped = sum(c > 30 for c in counts)
    assert skipped and any(
        f"warning: {skipped} training structure(s) have more than" in line for line in lines
    )
    assert result.history[-1]["step"] == 2 * steps and np.isfinite(result.history[-1]["val_loss"])
    for bad, message in (
        ({"max_atoms_per_batch": 0}, "max_atoms_per_batch' must be positive"),
        ({"min_atoms_per_batch": 5}, "min_atoms_per_batch' needs"),
        ({"max_atoms_per_batch": 30, "min_atoms_per_batch": 31}, "exceeds"),
        ({"max_atoms_per_batch": 5}, "no training batch is left"),
    ):
        with pytest.raises(ValueError, match=message):
            fit(tiny_options(dataset, num_epochs=1, **bad), None, progress=False, log=quiet())


def test_batch_plan_shards():
    """Training shards (``batch_size`` per process): step k of W processes is the
    one-process batch k of W * batch_size, shared with at most one structure of
    difference, the lone partial batch of a small set included (it was cut to a
    multiple of W: 3 structures trained as 2)."""
    for n, size, world, drop_last in (
        (23, 4, 2, True),
        (23, 4, 2, False),
        (3, 2, 2, True),
        (10, 3, 3, True),
        (7, 8, 2, True),
        (40, 4, 2, True),
        (5, 1, 4, False),
    ):
        full = batch_plan(n, size * world, epoch=2, seed=5, drop_last=drop_last)
        shards = [
            batch_plan(n, size, epoch=2, seed=5, drop_last=drop_last, rank=r, world_size=world)
            for r in range(world)
        ]
        expected = [b for b in full if len(b) >= world]  # (5, 1, 4): the last structure alone is left out
        assert all(len(s) == len(expected) for s in shards), (n, size, world)
        for k, batch in enumerate(expected):
            parts = [s[k] for s in shards]
            assert 1 <= min(map(len, parts)) and max(map(len, parts)) - min(map(len, parts)) <= 1
            assert sorted(np.concatenate(parts).tolist()) == sorted(batch.tolist()), (n, size, world, k)
    assert [len(b) for b in batch_plan(3, 2, rank=0, world_size=2)] == [2]
    # a structure cannot be shared by two processes: no step (fit says so)
    assert batch_plan(1, 4, rank=0, world_size=2) == []
    # drop_last drops the partial batch; other epochs shuffle differently.
    assert [len(x) for x in batch_plan(23, 4, epoch=2, seed=5)] == [4] * 5
    assert not np.array_equal(
        np.concatenate(batch_plan(23, 4, epoch=3, seed=5)), np.concatenate(batch_plan(23, 4, epoch=2, seed=5))
    )


def test_batch_plan_one_file_per_batch():
    """Several training files (metatrain's combined loader): every batch comes from
    one file, each file drops its own partial batch, the batch order mixes files."""
    groups = [10, 7, 5]
    starts = np.cumsum([0] + groups)

    def file_of(batch):
        files = {int(np.searchsorted(starts, i, side="right") - 1) for i in batch}
        assert len(files) == 1, batch
        return files.pop()

    plan = batch_plan(22, 4, epoch=1, seed=3, groups=groups)
    assert [len(b) for b in plan] == [4] * 4  # 2 + 1 + 1 full batches
    assert sorted(file_of(b) for b in plan) == [0, 0, 1, 2]
    orders = {tuple(file_of(b) for b in batch_plan(22, 4, epoch=e, seed=3, groups=groups)) for e in range(10)}
    assert len(orders) > 3  # the files' batches are shuffled together, differently each epoch
    flat = np.concatenate(plan)
    assert len(set(flat.tolist())) == len(flat)
    # unshuffled, no drop: file order, every structure once
    ordered = batch_plan(22, 4, shuffle=False, drop_last=False, groups=groups)
    assert [file_of(b) for b in ordered] == [0, 0, 0, 1, 1, 2, 2]
    assert np.concatenate(ordered).tolist() == list(range(22))
    # ranks: disjoint shards of each file, and the same number of steps
    shards = [batch_plan(22, 2, epoch=0, seed=3, rank=r, world_size=2, groups=groups) for r in range(2)]
    assert len(shards[0]) == len(shards[1])
    assert not set(np.concatenate(shards[0]).tolist()) & set(np.concatenate(shards[1]).tolist())
    for shard in shards:
        for b in shard:
            file_of(b)
    # one file is the plain rule
    assert all(
        np.array_equal(a, b)
        for a, b in zip(batch_plan(22, 4, epoch=1, seed=3, groups=[22]), batch_plan(22, 4, epoch=1, seed=3))
    )
    with pytest.raises(ValueError, match="do not add up"):
        batch_plan(22, 4, groups=[10, 10])


def test_uneven_shards_cover_every_structure_once():
    # evaluation shards: no structure dropped, none repeated, a rank may get none
    for n, world in ((23, 2), (7, 3), (2, 4)):
        shards = [
            batch_plan(n, 4, shuffle=False, drop_last=False, rank=r, world_size=world, even_shards=False)
            for r in range(world)
        ]
        flat = np.concatenate([np.concatenate(s) if s else np.zeros(0, dtype=int) for s in shards])
        assert sorted(flat.tolist()) == list(range(n))
    assert batch_plan(2, 4, shuffle=False, drop_last=False, rank=3, world_size=4, even_shards=False) == []


def test_augmentation_does_not_depend_on_the_process(dataset):
    """A structure is rotated the same way in an epoch whichever process takes it:
    N processes with batch B see the batches of one process with N * B (the
    rotations were drawn per rank, and 1 and 2 processes trained models 7 % apart)."""
    import ase.io

    from petfunc import PETConfig
    from petfunc.data import sample_from_atoms
    from petfunc.trainer import iterate_batches

    frames = ase.io.read(dataset, ":10")
    config = PETConfig(atomic_types=tuple(sorted({int(z) for a in frames for z in a.numbers})), **TINY_MODEL)
    samples = [sample_from_atoms(a, config) for a in frames]
    w, c = np.zeros(config.num_species), 1.0

    def rotated(batch_size, rank=0, world_size=1, epoch=1):
        out = {}
        for idx, batch in iterate_batches(
            samples,
            config,
            w,
            c,
            batch_size,
            epoch=epoch,
            seed=7,
            augment=True,
            dtype=torch.float64,
            rank=rank,
            world_size=world_size,
        ):
            offsets = np.cumsum([0] + [len(samples[i]) for i in idx])
            for k, i in enumerate(idx):
                out[int(i)] = batch.forces[offsets[k] : offsets[k + 1]].clone()
        return out

    one = rotated(4)
    two = {**rotated(2, 0, 2), **rotated(2, 1, 2)}
    assert sorted(one) == sorted(two) and len(one) == 8
    for i in one:
        assert torch.equal(one[i], two[i]), i
        assert not torch.allclose(one[i], torch.as_tensor(samples[i].forces)), i  # rotated
    assert not all(torch.equal(one[i], v) for i, v in rotated(4, epoch=2).items() if i in one)
