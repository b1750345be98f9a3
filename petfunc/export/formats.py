"""The formats a model is written in, chosen by the file name: :func:`export_model`.

==========================  =========  ============================================
format                      extension  what reads it
==========================  =========  ============================================
``metatomic``               ``.pt``    LAMMPS, i-PI, ASE (metatomic-ase), torch-sim,
                                       ``mtt eval``: :func:`export_metatomic`
``pt2``                     ``.pt2``   petfunc, AOTInductor: :func:`petfunc.export.export`
``metatrain-checkpoint``    ``.ckpt``  ``mtt export``, ``mtt train --restart``,
                                       petfunc: :func:`petfunc.io.save_metatrain`
==========================  =========  ============================================
"""

from __future__ import annotations

from pathlib import Path

import torch

from petfunc._files import PathLike
from petfunc.config import PETConfig
from petfunc.export.metatomic import export_metatomic
from petfunc.export.package import export
from petfunc.io import save_metatrain


#: each format's file-name extension
FORMATS = {"metatomic": ".pt", "pt2": ".pt2", "metatrain-checkpoint": ".ckpt"}

#: the extensions of an exported model (``petfunc train -o FILE``: a path ending so
#: names the model file, any other the run folder)
MODEL_SUFFIXES = (".pt2", ".pt")


def format_of(path: PathLike, format: str | None = None) -> str:
    """The format of the file ``path``: ``format`` if given, else the one its
    extension names. A file whose extension is another format's is refused, as is
    an extension no format has without ``format``."""
    suffix = Path(path).suffix
    by_suffix = {ext: name for name, ext in FORMATS.items()}
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown export format {format!r}; choose one of {sorted(FORMATS)}")
        if suffix in by_suffix and by_suffix[suffix] != format:
            raise ValueError(
                f"{str(path)!r} has the extension of the {by_suffix[suffix]} format, not of {format} "
                f"({FORMATS[format]}): rename the file or choose --format {by_suffix[suffix]}"
            )
        return format
    if suffix not in by_suffix:
        choices = ", ".join(f"{ext} ({name})" for name, ext in FORMATS.items())
        raise ValueError(
            f"cannot tell the format of {str(path)!r} from its extension: name it {choices}, "
            "or give the format (--format)"
        )
    return by_suffix[suffix]


def check_model_file(path: PathLike) -> Path:
    """``path`` as a :class:`~pathlib.Path` when an exported model can be written
    there, checked before a run that ends by writing it starts.

    Raises:
        ValueError: the extension is not an exported model's (``.pt2``, ``.pt``),
            ``path`` is an existing folder, or a metatomic model (``.pt``) is asked
            for without the ``metatrain`` extra.
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
    if format_of(path) == "metatomic":
        try:
            import metatomic.torch  # noqa: F401 - an optional dependency
        except ImportError:
            raise ValueError(
                f"the model file {str(path)!r}: writing metatomic models needs the metatrain extra "
                "(pip install 'petfunc[metatrain]'); or write a .pt2 (petfunc's PT2 archive)"
            ) from None
    return path


def export_model(
    config: PETConfig,
    params,
    path: PathLike,
    format: str | None = None,
    dtype: torch.dtype | None = None,
    **pt2_options,
) -> Path:
    """Write ``(config, params)`` to ``path`` in ``format`` (default: by its extension,
    :func:`format_of`).

    ``dtype``: the network's dtype in the file (default: float32 for ``pt2``, the
    weights' own otherwise). ``pt2_options`` (``device``, ``aoti``,
    ``inductor_configs``, ``long_range``) go to :func:`petfunc.export.export` and are
    refused for the other formats. LoRA adapters must be merged first. Returns the
    path written.
    """
    kind = format_of(path, format)
    if kind == "pt2":
        return export(config, params, path, dtype=dtype or torch.float32, **pt2_options)
    given = sorted(k for k, v in pt2_options.items() if v is not None)
    if given:
        raise ValueError(f"{', '.join(given)}: options of the pt2 format, not of {kind} ({str(path)!r})")
    if kind == "metatomic":
        return export_metatomic(config, params, path, dtype=dtype)
    save_metatrain(config, params, path, dtype=dtype)
    return Path(path)
