"""Training, validation and test splits, drawn as ``mtt train`` draws them.

With the same seed petfunc and metatrain train on the same structures in the same
order, so their runs (and the composition fit's accumulation) can be compared.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import numpy as np


def split_indices(n: int, fraction: float | None, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """``(train, validation)`` indices into a file of ``n`` structures, drawn as
    ``mtt train`` draws them with the same ``seed``, so both train on the same
    structures, in the same order (which the composition fit's accumulation sees).

    metatrain seeds numpy's global generator and shuffles twice: the validation split
    takes the last ``floor(n * fraction)`` of a shuffled ``range(n)``, then its test
    split (``test_set: 0``, the only one petfunc accepts) shuffles the training part
    again. ``fraction=None`` (a separate validation file) skips the first shuffle.
    As in metatrain, a fraction below ``1/n`` gives no validation structure.
    See :func:`split_datasets` for several files.
    """
    ((train, val, _),) = split_datasets([n], fraction, seed)
    return train, val


def restart_split(
    ckpt: Mapping, sizes: Sequence[int], fraction: float | None, seed: int, partition: bool = True
):
    """The ``(train, validation, test)`` split of the run a checkpoint continues: as
    stored, or for checkpoints written before the split was stored, as those
    versions drew it (a seeded permutation, ``round(fraction * n)`` validation
    structures, both parts sorted, no test set). ``partition``: the parts must
    cover each file exactly (without explicit ``indices``, which may select a
    subset)."""
    empty = np.zeros(0, dtype=np.int64)
    stored = ckpt.get("split")
    if stored is None:
        out = []
        for n in sizes:
            if fraction is None or fraction <= 0:
                out.append((np.arange(n), empty, empty))
                continue
            n_val = max(1, int(round(fraction * n)))
            order = np.random.default_rng(seed).permutation(n)
            out.append((np.sort(order[n_val:]), np.sort(order[:n_val]), empty))
        return out
    train, val = stored["training"], stored["validation"]
    test = stored.get("test") or [[] for _ in train]
    if len(train) != len(sizes) or any(
        max(list(t) + list(v) + list(s), default=-1) >= n or (partition and len(t) + len(v) + len(s) != n)
        for t, v, s, n in zip(train, val, test, sizes)
    ):
        raise ValueError(
            "the training data changed since the checkpoint was written: it was split into "
            f"{[len(t) + len(v) + len(s) for t, v, s in zip(train, val, test)]} structures per file, "
            f"the files now hold {list(sizes)}"
        )
    return [tuple(np.asarray(part, dtype=np.int64) for part in parts) for parts in zip(train, val, test)]


def split_datasets(
    sizes: Sequence[int], fraction: float | None, seed: int, test_fraction: float | None = 0.0
):
    """:func:`split_indices` for several files of ``sizes`` structures, with
    metatrain's order of draws from one generator: the validation split of every
    file, then the test split of every training part. Returns ``(train,
    validation, test)`` file indices per file (test empty without a test fraction).

    ``test_fraction``: the fraction of each whole file for the test set
    (``test_set: f``; metatrain's default 0 still reshuffles the training part), or
    ``None`` for a separate test file (no reshuffle)."""
    rng = np.random.RandomState(seed % 2**32)
    # metatrain's running "train_size": each split normalises (train, part) by their sum
    train_size = 1.0
    splits = []
    if fraction is not None and fraction > 0:
        train_size -= fraction
    for n in sizes:
        indices = list(range(n))
        n_val = 0
        if fraction is not None and fraction > 0:
            rng.shuffle(indices)
            n_val = math.floor(n * (fraction / (train_size + fraction)))
            if n_val >= n:
                raise ValueError(
                    f"validation_set: a fraction of {fraction} of {n} structures leaves none for training"
                )
        splits.append((indices[: n - n_val], indices[n - n_val :]))
    if test_fraction is not None:
        train_size -= test_fraction
        if not train_size > 0:
            raise ValueError("validation_set and test_set take all of the data: nothing is left to train on")
    out = []
    for train, val in splits:
        test = []
        if test_fraction is not None:
            order = list(range(len(train)))
            rng.shuffle(order)
            n_test = math.floor(len(train) * (test_fraction / (train_size + test_fraction)))
            if n_test >= len(train):
                raise ValueError(f"test_set: a fraction of {test_fraction} leaves no structure for training")
            test = [train[i] for i in order[len(train) - n_test :]]
            train = [train[i] for i in order[: len(train) - n_test]]
        out.append(tuple(np.array(part, dtype=np.int64) for part in (train, val, test)))
    return out
