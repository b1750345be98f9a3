"""Loading a deployment artifact: :func:`load` gives an :class:`ExportedPET`.

An artifact with an AOTInductor library holds native code, which runs in this
process when the library is loaded. :func:`load` loads it by default only for files
this machine exported (:mod:`petfunc.export.trust`); any other file runs as its
exported program, unless ``aoti=True`` says that its library is trusted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import tempfile
import warnings
import zipfile
from pathlib import Path

import torch

from petfunc._files import not_a_file
from petfunc.config import PETConfig
from petfunc.export.inputs import N_GRAPH_FIELDS, input_names, is_fixed, long_range_inputs
from petfunc.export.package import FORMAT, METADATA, READABLE_VERSIONS
from petfunc.export.trust import recorded
from petfunc.graph import Neighbors


class ExportedPET:
    """A loaded artifact: ``model(positions, cell, neighbors) -> (energy, energies,
    forces, strain_derivative)`` (see the module docstring for units and shapes).

    Attributes:
        config: the :class:`PETConfig` (to build neighbour inputs).
        dtype, device: of the computation.
        aoti: True when the AOTInductor library runs, False for the exported program.
        long_range: ``"p3m"`` or ``"ewald"`` for a model with long-range features
            (the method its inputs are built for), else None.
    """

    def __init__(self, config, runner, dtype, device, aoti, metadata):
        self.config = config
        self._run = runner
        self.dtype = dtype
        self.device = device
        self.aoti = aoti
        self.metadata = metadata
        self.long_range = metadata.get("long_range")
        self.inputs = input_names(self.long_range)

    def __repr__(self) -> str:
        kind = "AOTInductor" if self.aoti else "exported program"
        return f"ExportedPET({kind}, {self.dtype}, {self.device}, atomic_types={self.config.atomic_types})"

    def __call__(
        self, positions: torch.Tensor, cell: torch.Tensor, neighbors: Neighbors
    ) -> tuple[torch.Tensor, ...]:
        inputs = (positions, cell, *neighbors[:N_GRAPH_FIELDS])
        if self.long_range:
            inputs += long_range_inputs(neighbors, cell, self.config, self.long_range)
        for name, t in zip(self.inputs, inputs):
            if any(size < 2 for d, size in enumerate(t.shape) if not is_fixed(name, d)):
                raise ValueError(
                    f"every size of the exported model's inputs must be at least 2, but "
                    f"{name!r} has shape {tuple(t.shape)}: batch a single structure with "
                    "petfunc.structures.padding_structure(config), as PETCalculator does"
                )
        if positions.dtype != self.dtype:
            raise ValueError(f"positions must be {self.dtype}, got {positions.dtype}")
        with torch.no_grad():
            out = self._run(*(t.to(self.device) for t in inputs))
        return tuple(out)


def load(path, aoti: bool | None = None) -> ExportedPET:
    """Load an artifact written by :func:`export`.

    Args:
        path: the ``.pt2`` file.
        aoti: load and run the AOTInductor library (``True``: the file is trusted,
            since the library is native code that runs when it is loaded), run the
            exported program (``False``, needs no compiler and runs on any device),
            or (``None``, default) the library when the file has one and this
            machine exported it, else the program, with a warning.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "exported model"))
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{str(path)!r} is not a PT2 archive written by petfunc export")
    try:
        with zipfile.ZipFile(path) as archive:
            names = [n for n in archive.namelist() if n.endswith("extra/" + METADATA)]
            models = {
                n.split("/")[-2]
                for n in archive.namelist()
                if "/data/aotinductor/" in n and n.count("/") >= 4
            }
            raw = archive.read(names[0]).decode() if names else None
    except (zipfile.BadZipFile, OSError, UnicodeDecodeError) as error:
        raise ValueError(
            f"{str(path)!r} is not a readable PT2 archive (damaged or truncated?): {error}"
        ) from None
    if raw is None:
        raise ValueError(f"{str(path)!r} has no {METADATA}: not an archive written by petfunc export")
    metadata = json.loads(raw)
    if metadata.get("format") != FORMAT or metadata.get("version") not in READABLE_VERSIONS:
        raise ValueError(
            f"{str(path)!r}: unsupported format {metadata.get('format')!r} version "
            f"{metadata.get('version')!r} (this petfunc reads {FORMAT!r} versions "
            f"{', '.join(map(str, READABLE_VERSIONS))})"
        )
    config = PETConfig.from_hypers(metadata["hypers"])
    dtype = getattr(torch, metadata["dtype"])
    has_aoti = bool(metadata.get("aoti")) and "model" in models
    if aoti and not has_aoti:
        raise ValueError(f"{str(path)!r} has no AOTInductor library (exported with aoti=False)")
    use_aoti = _trusted_library(path) if aoti is None and has_aoti else bool(aoti)
    # the weights are constants on the device the model was exported for
    device = torch.device(metadata["device"])
    with _quiet_deserializer():
        runner = _runner(path, use_aoti)
    return ExportedPET(config, runner, dtype, device, use_aoti, metadata)


@contextlib.contextmanager
def _quiet_deserializer():
    """Silence torch's deserializer warnings about size symbols that the saved graph
    no longer mentions (harmless; one per such symbol at every load)."""
    logger = logging.getLogger("torch._export.serde.serialize")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _trusted_library(path: Path) -> bool:
    """Whether :func:`load` with ``aoti=None`` loads the library of ``path``: when this
    machine exported the file, byte for byte."""
    if recorded(path):
        return True
    warnings.warn(
        f"{str(path)!r} holds an AOTInductor library, native code that runs when it is loaded, "
        "and was not exported on this machine: running its exported program instead. Load it "
        "with aoti=True (petfunc.export.load, PETCalculator.from_exported) if you trust the file",
        UserWarning,
        stacklevel=3,
    )
    return False


def _runner(path: Path, use_aoti: bool):
    if use_aoti:
        from torch._inductor.package import load_package

        return load_package(str(path), model_name="model")
    return _program(path)


def _program(path: Path):
    """The archive's exported program, read from a copy without its AOTInductor
    members: ``torch.export.load`` loads every library an archive holds."""
    with zipfile.ZipFile(path) as source, tempfile.TemporaryDirectory(prefix="petfunc-program-") as scratch:
        copy = Path(scratch) / path.name
        with zipfile.ZipFile(copy, "w") as target:
            for info in source.infolist():
                if "/data/aotinductor/" not in info.filename:
                    target.writestr(info, source.read(info))
        return torch.export.load(str(copy)).module()
