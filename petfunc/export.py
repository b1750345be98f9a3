"""Deployment artifacts: a PET with its weights, as one file that runs without petfunc.

:func:`export` writes a PT2 archive (``torch.export``'s package format, a zip file)
holding the pure function

    ``(positions, cell, *neighbors) -> (energy, energies, forces, strain_derivative)``

with the weights inside as constants:

* ``models/model``: the ``torch.export`` ``ExportedProgram`` (aten ops, dynamic sizes);
* with ``aoti=True`` (the default for the CPU), the same program compiled ahead of
  time by AOTInductor for the chosen device: a shared library plus weights, loadable
  from Python (``torch._inductor.aoti_load_package``) or from C++
  (``torch::inductor::AOTIModelPackageLoader``), without Python model code. For a
  GPU the default is the program alone: the one AOTInductor build for a GPU tried
  so far (H200, torch 2.11) crashed the process that loaded it, inside torch's
  package loader, while the program ran there and equalled eager;
* ``extra/petfunc.json``: the model hypers (cutoff, adaptive cutoff, atomic types:
  everything needed to build the neighbour inputs), dtype, device and the input and
  output contract below.

The graph is built like every compiled petfunc function: ``make_fx`` of
:func:`petfunc.derivatives.energy_terms_forces_strain_derivative` (forces and the strain
derivative by ``torch.func.grad``, adaptive-cutoff terms included) on inputs with
symbolic sizes, then ``torch.export`` with every data size dynamic. One artifact
serves any number of structures, atoms, edges and neighbours.

Inputs (sizes: S structures, N atoms, E edges, K kept edges, M NEF width; every size
must be at least 2: add :func:`petfunc.data.padding_sample` to a single structure,
as :class:`petfunc.ase.PETCalculator` does):

==================  ==============  =========================================
``positions``       [N, 3] float    Å
``cell``            [S, 3, 3] float rows are lattice vectors, zero if not periodic
``species`` ...     see :class:`petfunc.neighbors.Neighbors` (10 integer/bool tensors,
                                    in its field order)
==================  ==============  =========================================

Outputs: ``energy`` [S] (eV), ``energies`` [N] (eV per atom), ``forces`` [N, 3]
(eV/Å), ``strain_derivative`` [S, 3, 3] (dE/d eps in eV; stress = this / volume).

:func:`load` returns an :class:`ExportedPET`, and
:meth:`petfunc.ase.PETCalculator.from_exported` an ASE calculator on top of it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Optional, Tuple

import numpy as np
import torch

from .config import PETConfig
from .derivatives import energy_terms_forces_strain_derivative
from .io import cast_params
from .neighbors import Neighbors


FORMAT = "petfunc.exported"
VERSION = 2  # 2: Neighbors gained charge and spin_multiplicity
METADATA = "petfunc.json"
# long-range inputs (meshes, k-grids) are not part of the artifact's interface
INPUTS = ("positions", "cell") + tuple(f for f in Neighbors._fields if f != "long_range")
N_GRAPH_FIELDS = len(INPUTS) - 2
OUTPUTS = ("energy", "energies", "forces", "strain_derivative")

__all__ = ["export", "load", "ExportedPET"]


def _example_inputs(config: PETConfig, dtype, device):
    """A two-structure batch whose sizes are all >= 2 and mostly distinct."""
    from .data import padding_sample
    from .structures import collate, prepare

    rng = np.random.default_rng(0)
    n = 5
    # a compact cluster (every pair within the cutoff), all species represented
    positions = rng.uniform(0.0, 0.35 * config.cutoff, size=(n, 3))
    numbers = [config.atomic_types[i % len(config.atomic_types)] for i in range(n)]
    cluster = prepare(numbers, positions, None, False, config, "example")
    return collate([cluster, padding_sample(config).structure], config, dtype=dtype, device=device)


class _Flat(torch.nn.Module):
    """``torch.export`` wants a module; this one holds only the traced graph."""

    def __init__(self, graph):
        super().__init__()
        self.graph_module = graph

    def forward(self, *inputs):
        return self.graph_module(*inputs)


def trace(config: PETConfig, params, dtype=torch.float32, device="cpu"):
    """The ``torch.export`` program of the artifact (weights as constants).

    Returns ``(exported_program, example_inputs)``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from .compile import _fake_inputs, _move_graph, _trace_device, no_duck_shape
    from .model import PET

    device = torch.device(device)
    positions, cell, neighbors = _example_inputs(config, dtype, device)
    example = (positions, cell, *neighbors[:N_GRAPH_FIELDS])
    # for a GPU: traced on the CPU, then moved, as petfunc.compile does (see _trace_device)
    trace_device = _trace_device(list(example))
    params = cast_params(params, dtype, trace_device or device)
    fn = energy_terms_forces_strain_derivative(PET(config).energy_terms)

    def flat(positions, cell, *fields):
        return fn(params, positions, cell, Neighbors(*fields))

    mode, fakes = _fake_inputs(list(example), [False] * len(example), trace_device)
    with mode, torch.no_grad():
        graph = make_fx(flat, tracing_mode="real")(*fakes)
    graph.graph.eliminate_dead_code()
    if trace_device is not None:
        _move_graph(graph, trace_device, device)
    graph.recompile()

    auto = torch.export.Dim.AUTO
    dynamic = tuple({d: auto for d in range(t.dim()) if not _is_xyz(name, d)} for name, t in zip(INPUTS, example))
    with torch.no_grad(), no_duck_shape():
        program = torch.export.export(_Flat(graph), example, dynamic_shapes=(dynamic,), strict=False)
    _check_dynamic(program)
    return program, example


def _is_xyz(name: str, dim: int) -> bool:
    """The fixed-size axes: the 3 of xyz and of cell vectors."""
    return (name in ("positions", "cell_shifts") and dim == 1) or (name == "cell" and dim > 0)


def _check_dynamic(program) -> None:
    """Every data size must have stayed symbolic (no silent specialisation)."""
    user_inputs = set(program.graph_signature.user_inputs)
    user = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    for name, node in zip(INPUTS, user):
        value = node.meta.get("val")
        for d, size in enumerate(value.shape):
            if not _is_xyz(name, d) and not isinstance(size, torch.SymInt):
                raise RuntimeError(f"export specialised size {d} of {name!r} to {size}")


def export(
    config: PETConfig,
    params,
    path,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    aoti: Optional[bool] = None,
    inductor_configs: Optional[dict] = None,
) -> Path:
    """Write the deployment artifact of ``(config, params)`` to ``path`` (``.pt2``).

    Args:
        config, params: the model (weights are cast to ``dtype``; composition
            weights and energy scale keep float64 as in evaluation).
        path: output file; must end in ``.pt2``. Written atomically.
        dtype: computation dtype, ``torch.float32`` or ``torch.float64``.
        device: ``"cpu"`` or ``"cuda"``; an AOTInductor artifact runs on this device
            only, the exported program on any.
        aoti: also compile the program with AOTInductor (minutes on a CPU).
            Default (None): on the CPU only (see the module docstring for GPUs).
        inductor_configs: options for AOTInductor.
    Returns:
        the path written.
    """
    from torch.export.pt2_archive._package import package_pt2

    if config.long_range.enable:
        raise NotImplementedError(
            "petfunc export does not support long-range models yet (their P3M meshes "
            "and k-grids are not part of the artifact's inputs); use PETCalculator"
        )
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"the exported model's file name must end in .pt2, got {str(path)!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    device = torch.device(device)
    aoti = default_aoti(device) if aoti is None else bool(aoti)
    program, example = trace(config, params, dtype, device)
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "hypers": config.to_hypers(),
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
        "aoti": bool(aoti),
        "inputs": list(INPUTS),
        "outputs": list(OUTPUTS),
        "torch": torch.__version__,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    # built next to the target and renamed into place: a failed export leaves no file
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".petfunc-export-") as scratch:
        aoti_files = None
        if aoti:
            options = dict(inductor_configs or {})
            options["aot_inductor.package"] = True
            module = program.module(check_guards=False) if _has_check_guards() else program.module()
            with torch.no_grad():
                aoti_files = {"model": torch._inductor.aot_compile(module, example, options=options)}
        partial = Path(scratch) / path.name  # the archive's root folder is its stem
        package_pt2(
            str(partial),
            exported_programs={"model": program},
            aoti_files=aoti_files,
            extra_files={METADATA: json.dumps(metadata)},
        )
        os.replace(partial, path)
    return path


def default_aoti(device) -> bool:
    """Whether :func:`export` builds the AOTInductor library when not told: on the CPU
    yes; on a GPU no (its one build tried so far crashed the loading process: see
    the module docstring)."""
    return torch.device(device).type == "cpu"


def _has_check_guards() -> bool:
    import inspect

    return "check_guards" in inspect.signature(torch.export.ExportedProgram.module).parameters


class ExportedPET:
    """A loaded artifact: ``model(positions, cell, neighbors) -> (energy, energies,
    forces, strain_derivative)`` (see the module docstring for units and shapes).

    Attributes:
        config: the :class:`PETConfig` (to build neighbour inputs).
        dtype, device: of the computation.
        aoti: True when the AOTInductor library runs, False for the exported program.
    """

    def __init__(self, config, runner, dtype, device, aoti, metadata):
        self.config = config
        self._run = runner
        self.dtype = dtype
        self.device = device
        self.aoti = aoti
        self.metadata = metadata

    def __repr__(self) -> str:
        kind = "AOTInductor" if self.aoti else "exported program"
        return f"ExportedPET({kind}, {self.dtype}, {self.device}, atomic_types={self.config.atomic_types})"

    def __call__(self, positions: torch.Tensor, cell: torch.Tensor, neighbors: Neighbors) -> Tuple[torch.Tensor, ...]:
        inputs = (positions, cell, *neighbors[:N_GRAPH_FIELDS])
        for name, t in zip(INPUTS, inputs):
            if any(size < 2 for d, size in enumerate(t.shape) if not _is_xyz(name, d)):
                raise ValueError(
                    f"every size of the exported model's inputs must be at least 2, but "
                    f"{name!r} has shape {tuple(t.shape)}: batch a single structure with "
                    "petfunc.data.padding_sample(config), as PETCalculator does"
                )
        if positions.dtype != self.dtype:
            raise ValueError(f"positions must be {self.dtype}, got {positions.dtype}")
        with torch.no_grad():
            out = self._run(*(t.to(self.device) for t in inputs))
        return tuple(out)


def load(path, aoti: Optional[bool] = None) -> ExportedPET:
    """Load an artifact written by :func:`export`.

    Args:
        path: the ``.pt2`` file.
        aoti: run the AOTInductor library (``True``), the exported program
            (``False``, needs no compiler and runs on any device), or the library
            when the file has one (``None``, default).
    """
    import zipfile

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"exported model not found: {str(path)!r}")
    if not zipfile.is_zipfile(path):
        raise ValueError(f"{str(path)!r} is not a PT2 archive written by petfunc export")
    with zipfile.ZipFile(path) as archive:
        names = [n for n in archive.namelist() if n.endswith("extra/" + METADATA)]
        models = {n.split("/")[-2] for n in archive.namelist() if "/data/aotinductor/" in n and n.count("/") >= 4}
        raw = archive.read(names[0]).decode() if names else None
    if raw is None:
        raise ValueError(f"{str(path)!r} has no {METADATA}: not an archive written by petfunc export")
    metadata = json.loads(raw)
    if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
        raise ValueError(
            f"{str(path)!r}: unsupported format {metadata.get('format')!r} version "
            f"{metadata.get('version')!r} (this petfunc reads {FORMAT!r} version {VERSION})"
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
