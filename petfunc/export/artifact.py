"""Loading a deployment artifact: :func:`load` gives an :class:`ExportedPET`.

Loading an artifact with an AOTInductor library loads that library: native code
from the file, which runs in this process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import zipfile
from pathlib import Path

import torch

from petfunc._files import not_a_file
from petfunc.config import PETConfig
from petfunc.export.inputs import N_GRAPH_FIELDS, input_names, is_fixed, long_range_inputs
from petfunc.export.package import FORMAT, METADATA, READABLE_VERSIONS
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
        aoti: run the AOTInductor library (``True``), the exported program
            (``False``, needs no compiler and runs on any device), or the library
            when the file has one (``None``, default).
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
    use_aoti = has_aoti if aoti is None else aoti
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


def _runner(path: Path, use_aoti: bool):
    if use_aoti:
        from torch._inductor.package import load_package

        return load_package(str(path), model_name="model")
    # the program only (torch.export.load reads the archive's "model" program)
    return torch.export.load(str(path)).module()
