"""A petfunc model as a metatomic ``AtomisticModel``: what ``mtt export`` writes.

The simulation engines PET users run load metatomic models: LAMMPS (``pair_style
metatomic``), i-PI, ASE (``metatomic_ase.MetatomicCalculator``), torch-sim
(``torch_sim.models.metatomic``) and metatrain's own ``mtt eval``.
:func:`export_metatomic` writes one: metatrain's PET is built from ``(config,
params)`` by :func:`petfunc.io.metatrain.metatrain_model` (the architecture, the
composition weights and energy scale, ZBL, long-range features; LoRA adapters must
be merged first, as :func:`petfunc.io.load_model` does) and exported by metatrain
(``PET.export()``), so the file is the one ``mtt export`` writes from the matching
metatrain checkpoint. Its output ``energy`` is in eV, lengths in Å, its
interaction range ``num_gnn_layers * cutoff`` (or the ZBL range if larger).

Needs the optional ``metatrain`` extra (``pip install 'petfunc[metatrain]'``).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import torch

from petfunc._files import PathLike
from petfunc.config import PETConfig
from petfunc.io.metatrain import metatrain_model


def export_metatomic(
    config: PETConfig,
    params,
    path: PathLike,
    dtype: torch.dtype | None = None,
    metadata=None,
) -> Path:
    """Write ``(config, params)`` as a metatomic ``AtomisticModel`` (TorchScript) to ``path``.

    Args:
        config, params: the model (Å, eV; without LoRA adapters: merge them first).
        path: the file to write, conventionally ``model.pt``; written atomically.
        dtype: the dtype the model computes in, ``torch.float32`` or ``torch.float64``
            (default: that of the network weights). metatomic's calculators run
            the model in this dtype and convert positions and cells to it.
        metadata: a ``metatomic.torch.ModelMetadata`` (name, authors, description,
            references) merged into metatrain's (which cites the PET paper).
    Returns:
        the path written.
    """
    path = Path(path)
    model = metatrain_model(config, params, dtype)
    if config.long_range.enable:
        # each neighbour pair's distance from its own row, whatever the engine's order
        from petfunc.export.metatomic_long_range import (  # noqa: PLC0415 - it imports metatrain
            RowAlignedLongRangeFeaturizer,
        )

        model.long_range_featurizer.__class__ = RowAlignedLongRangeFeaturizer
    atomistic = model.export(metadata)
    path.parent.mkdir(parents=True, exist_ok=True)
    # saved next to the target and renamed into place: a failed export leaves no file
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".petfunc-export-") as scratch:
        partial = Path(scratch) / path.name
        atomistic.save(str(partial))
        os.replace(partial, path)
    return path
