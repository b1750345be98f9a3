"""The model files a trained model is exported to, chosen by the file's suffix: the
one place that maps a suffix to its writer, for ``petfunc train -o FILE`` and
``petfunc export``.

* ``.pt2``: petfunc's PT2 archive (:func:`petfunc.export.export`);
* ``.pt``: a metatomic model, as ``mtt export`` writes it, when this petfunc has a
  writer for it (:data:`WRITERS`); otherwise an error that says so, raised by
  :func:`check_model_file` before any training starts.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

from petfunc.config import PETConfig
from petfunc.export.package import export


def write_pt2(config: PETConfig, params, path, *, dtype, device, aoti, long_range) -> Path:
    """The PT2 archive of :func:`petfunc.export.export`."""
    return export(config, params, path, dtype=dtype, device=device, aoti=aoti, long_range=long_range)


#: suffix -> writer ``(config, params, path, *, dtype, device, aoti, long_range) -> Path``
WRITERS: dict[str, Callable[..., Path]] = {".pt2": write_pt2}

#: every suffix of a model file, written here or not (a path ending so is a model file)
MODEL_SUFFIXES = (".pt2", ".pt")


def check_model_file(path) -> Path:
    """``path`` as a :class:`~pathlib.Path` when a model can be written there.

    Raises:
        ValueError: the suffix is not a model file's (``.pt2``, ``.pt``), or ``path``
            is an existing folder.
        NotImplementedError: this petfunc has no writer for the suffix (a metatomic
            ``.pt`` without one).
    """
    path = Path(path)
    if path.suffix not in MODEL_SUFFIXES:
        raise ValueError(
            f"the model file {str(path)!r} must end in .pt2 (petfunc's PT2 archive) or .pt "
            "(a metatomic model)"
        )
    if path.is_dir():
        raise ValueError(
            f"the model file {str(path)!r} is an existing folder: remove it or choose another name"
        )
    if path.suffix not in WRITERS:
        raise NotImplementedError(
            f"the model file {str(path)!r}: this petfunc cannot write metatomic models (.pt); "
            "write a .pt2 (petfunc's PT2 archive) instead"
        )
    return path


def export_model(
    config: PETConfig,
    params,
    path,
    *,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    aoti: bool | None = None,
    long_range: str | None = None,
) -> Path:
    """Write the model ``(config, params)`` to ``path`` in the format of its suffix
    (:data:`WRITERS`); returns the path written.

    Args:
        config, params: the model.
        path: the file: ``.pt2`` (petfunc's PT2 archive) or ``.pt`` (metatomic).
        dtype: the exported model's float type.
        device: the device the model is exported for (``"cpu"`` or ``"cuda"``).
        aoti: for ``.pt2``, also build the AOTInductor library (``None``: its default).
        long_range: for a long-range model, ``"p3m"`` or ``"ewald"``.

    Raises:
        ValueError / NotImplementedError: see :func:`check_model_file`.
    """
    path = check_model_file(path)
    writer = WRITERS[path.suffix]
    return writer(config, params, path, dtype=dtype, device=device, aoti=aoti, long_range=long_range)
