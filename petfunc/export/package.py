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
``species`` ...     see :class:`petfunc.graph.neighbors.Neighbors` (12 integer/bool tensors,
                                    in its field order, ``species`` to
                                    ``spin_multiplicity``)
==================  ==============  =========================================

Models with long-range features take the integer inputs of
:class:`petfunc.model.long_range.LongRange` after those, for the reciprocal-space method
chosen at export (``long_range``, recorded in the metadata):

* ``"p3m"`` (the default; what metatrain, :func:`petfunc.from_atoms` and the ASE
  calculator evaluate with): ``lr_structure_atoms``, ``lr_structure_mask``,
  ``lr_atom_slot``, ``lr_periodic``, ``lr_mesh_sizes``, ``lr_mesh`` (the
  ``[n_a, n_b, n_c]`` mesh of the first structure; a ``[2, 2, 2]`` tensor when it
  is a molecule), ``lr_pairs``, ``lr_pair_mask``. FFT sizes cannot vary per
  structure inside one graph, so **only the first structure of a call may be
  periodic**: one crystal (with any number of molecules after it), as the ASE
  calculator evaluates, or molecules only;
* ``"ewald"`` (what metatrain trains with): the same with ``lr_kgrid`` in place of
  the two mesh inputs, for batches of any number of periodic structures. Ewald sums
  differ from P3M by P3M's discretisation error (below 1e-2 relative in the
  long-range potentials at metatrain's default ``kspace_resolution``:
  ``tests/test_long_range.py``), and cost O(atoms x k-vectors).

:class:`ExportedPET` takes a :class:`petfunc.graph.neighbors.Neighbors` built either way
and rebuilds the long-range inputs for its own method when they differ.

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

import numpy as np
import torch

from petfunc._files import not_a_file
from petfunc.config import PETConfig
from petfunc.derivatives import energy_terms_forces_strain_derivative
from petfunc.graph.neighbors import Neighbors
from petfunc.io.params import cast_params


FORMAT = "petfunc.exported"
# 2: Neighbors gained charge and spin_multiplicity; 3: long-range inputs. Models
# without long-range features are still written as version 2, which older petfunc reads.
VERSION = 3
READABLE_VERSIONS = (2, 3)
METADATA = "petfunc.json"
# the inputs of every model; long-range models take LONG_RANGE_INPUTS after them
INPUTS = ("positions", "cell") + tuple(f for f in Neighbors._fields if f != "long_range")
N_GRAPH_FIELDS = len(INPUTS) - 2
_LR_COMMON = ("lr_structure_atoms", "lr_structure_mask", "lr_atom_slot", "lr_periodic")
_LR_PAIRS = ("lr_pairs", "lr_pair_mask")
LONG_RANGE_INPUTS = {
    "p3m": _LR_COMMON + ("lr_mesh_sizes", "lr_mesh") + _LR_PAIRS,
    "ewald": _LR_COMMON + ("lr_kgrid",) + _LR_PAIRS,
}
OUTPUTS = ("energy", "energies", "forces", "strain_derivative")

__all__ = ["export", "load", "ExportedPET"]


def input_names(long_range: str | None) -> tuple[str, ...]:
    """The artifact's input names, for long-range method ``long_range`` (None: a
    model without long-range features)."""
    return INPUTS + (LONG_RANGE_INPUTS[long_range] if long_range else ())


def _method(config: PETConfig, long_range: str | None) -> str | None:
    """The long-range method of an export: None without long-range features."""
    if not config.long_range.enable:
        return None
    method = "p3m" if long_range is None else long_range
    if method not in LONG_RANGE_INPUTS:
        raise ValueError(f"long_range must be one of {tuple(LONG_RANGE_INPUTS)}, got {long_range!r}")
    return method


def _example_inputs(config: PETConfig, dtype, device, long_range: str | None = None):
    """A batch whose sizes are all >= 2 and mostly distinct: a cluster and the padding
    molecule, after a small triclinic crystal for long-range models (whose k-grid or
    P3M mesh needs a periodic first structure)."""
    from petfunc.data.samples import padding_sample
    from petfunc.structures import collate, prepare

    rng = np.random.default_rng(0)
    n = 5
    # a compact cluster (every pair within the cutoff), all species represented
    positions = rng.uniform(0.0, 0.35 * config.cutoff, size=(n, 3))
    numbers = [config.atomic_types[i % len(config.atomic_types)] for i in range(n)]
    structures = [prepare(numbers, positions, None, False, config, "example")]
    if long_range:
        cell = np.array([[4.1, 0.0, 0.0], [0.4, 4.7, 0.0], [0.3, 0.6, 5.3]]) * max(1.0, config.cutoff / 4.5)
        fractions = rng.uniform(0.0, 1.0, size=(n + 1, 3))
        numbers = [config.atomic_types[i % len(config.atomic_types)] for i in range(n + 1)]
        crystal = prepare(numbers, fractions @ cell, cell, True, config, "example crystal")
        structures.insert(0, crystal)
    structures.append(padding_sample(config).structure)
    return collate(structures, config, dtype=dtype, device=device, long_range=long_range or "p3m")


# the mesh input when the first structure is a molecule (its k-space part is masked out)
_STAND_IN_MESH = (2, 2, 2)


def long_range_inputs(
    neighbors: Neighbors, cell: torch.Tensor, config: PETConfig, method: str
) -> tuple[torch.Tensor, ...]:
    """The long-range inputs of an artifact for ``method`` (in ``LONG_RANGE_INPUTS``
    order), from a batch's :class:`Neighbors`. Inputs built for the other method are
    rebuilt from the batch's cells, periodicity and atom counts.

    Raises:
        ValueError: no long-range inputs, or (P3M) a periodic structure other than the first.
    """
    from petfunc.model import long_range as lr

    inputs = neighbors.long_range
    if inputs is None:
        raise ValueError(
            "this exported model has long-range features but the neighbors carry no "
            "long-range inputs: build them with petfunc.from_atoms or collate for its config"
        )
    periodic = inputs.periodic.cpu()
    if method == "p3m" and bool(periodic[1:].any()):
        raise ValueError(
            "this exported model evaluates long-range features with P3M, whose meshes "
            "can differ per structure: only the first structure of a call may be "
            f"periodic, but structures {periodic.nonzero().flatten().tolist()} are. Call it once per "
            "crystal, or export with long_range='ewald' to batch crystals"
        )
    built_for = "ewald" if len(inputs.meshes) == 0 else "p3m"
    if built_for != method:
        counts = inputs.structure_mask.sum(dim=1).cpu().tolist()
        cells = cell.detach().cpu().double().numpy()
        pbcs = periodic.numpy()[:, None].repeat(3, axis=1)
        inputs = lr.build(config, counts, cells, pbcs, method=method, device=inputs.periodic.device)
    common = (inputs.structure_atoms, inputs.structure_mask, inputs.atom_slot, inputs.periodic)
    pairs = (inputs.pairs, inputs.pair_mask)
    if method == "ewald":
        return common + (inputs.kgrid,) + pairs
    mesh, mesh_sizes = inputs.meshes[0], inputs.mesh_sizes
    if mesh is None:
        # a molecule first: a stand-in mesh, whose result is masked out
        mesh = torch.zeros(_STAND_IN_MESH, dtype=torch.uint8, device=mesh_sizes.device)
        mesh_sizes = mesh_sizes.clone()
        mesh_sizes[0] = torch.tensor(_STAND_IN_MESH)
    return common + (mesh_sizes, mesh) + pairs


def _long_range_from_inputs(method: str | None, fields):
    """The :class:`petfunc.model.long_range.LongRange` inside the traced function."""
    if method is None:
        return None
    from petfunc.model.long_range import LeadingMeshes, LongRange

    atoms, mask, slot, periodic = fields[:4]
    pairs, pair_mask = fields[-2:]
    if method == "ewald":
        return LongRange(atoms, mask, slot, periodic, fields[4], None, (), pairs, pair_mask)
    # P3M for the first structure only; the others are molecules (their k-space part is zero)
    return LongRange(
        atoms, mask, slot, periodic, None, fields[4], LeadingMeshes((fields[5],)), pairs, pair_mask
    )


class _Flat(torch.nn.Module):
    """``torch.export`` wants a module; this one holds only the traced graph."""

    def __init__(self, graph):
        super().__init__()
        self.graph_module = graph

    def forward(self, *inputs):
        return self.graph_module(*inputs)


def trace(config: PETConfig, params, dtype=torch.float32, device="cpu", long_range: str | None = None):
    """The ``torch.export`` program of the artifact (weights as constants).

    ``long_range``: the reciprocal-space method of a long-range model, ``"p3m"``
    (default) or ``"ewald"``; ignored for other models.
    Returns ``(exported_program, example_inputs)``.
    """
    from torch.fx.experimental.proxy_tensor import make_fx

    from petfunc._torch.fft_meta import fft_meta
    from petfunc.compile import fake_inputs, move_graph, no_duck_shape, trace_device
    from petfunc.model.pet import PET

    device = torch.device(device)
    method = _method(config, long_range)
    names = input_names(method)
    positions, cell, neighbors = _example_inputs(config, dtype, device, method)
    example = (positions, cell, *neighbors[:N_GRAPH_FIELDS])
    if method:
        example += long_range_inputs(neighbors, cell, config, method)
    # for a GPU: traced on the CPU, then moved, as petfunc.compile does (see trace_device)
    traced_on = trace_device(list(example))
    params = cast_params(params, dtype, traced_on or device)
    fn = energy_terms_forces_strain_derivative(PET(config).energy_terms)

    def flat(positions, cell, *fields):
        long_range = _long_range_from_inputs(method, fields[N_GRAPH_FIELDS:])
        return fn(params, positions, cell, Neighbors(*fields[:N_GRAPH_FIELDS], long_range=long_range))

    mode, fakes = fake_inputs(list(example), [False] * len(example), traced_on)
    with mode, torch.no_grad(), fft_meta():
        graph = make_fx(flat, tracing_mode="real")(*fakes)
    graph.graph.eliminate_dead_code()
    if traced_on is not None:
        move_graph(graph, traced_on, device)
    graph.recompile()

    auto = torch.export.Dim.AUTO
    dynamic = tuple(
        {d: auto for d in range(t.dim()) if not _is_fixed(name, d)} for name, t in zip(names, example)
    )
    with torch.no_grad(), no_duck_shape(), fft_meta():
        program = torch.export.export(_Flat(graph), example, dynamic_shapes=(dynamic,), strict=False)
    _check_dynamic(program, names)
    return program, example


def _is_fixed(name: str, dim: int) -> bool:
    """The fixed-size axes: the 3 of xyz, of cell vectors, of k-vectors and of mesh
    sizes, and the 2 atoms of a long-range pair."""
    if name == "cell":
        return dim > 0
    if name in ("positions", "cell_shifts", "lr_mesh_sizes", "lr_pairs"):
        return dim == 1
    return name == "lr_kgrid" and dim == 2


def _check_dynamic(program, names=INPUTS) -> None:
    """Every data size must have stayed symbolic: not specialised to a number and
    not bounded beyond export's own ``[2, oo]`` (the inputs always hold at least the
    padding structure, so no size is 0 or 1). A bound would make the artifact refuse,
    at run time, batches that the eager model takes. The equalities between sizes
    that the graph needs (``centers`` and ``neighbors`` have one length, ...) are
    export's guards, checked at every call; the tests run the artifact on batches of
    many sizes against them."""
    from torch.utils._sympy.numbers import int_oo

    user_inputs = set(program.graph_signature.user_inputs)
    user = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    for name, node in zip(names, user):
        value = node.meta.get("val")
        for d, size in enumerate(value.shape):
            if not _is_fixed(name, d) and not isinstance(size, torch.SymInt):
                raise RuntimeError(f"export specialised size {d} of {name!r} to {size}")
    for symbol, bounds in program.range_constraints.items():
        if bounds.lower > 2 or bounds.upper != int_oo:
            raise RuntimeError(f"export bounded the size {symbol} to [{bounds.lower}, {bounds.upper}]")


def export(
    config: PETConfig,
    params,
    path,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    aoti: bool | None = None,
    inductor_configs: dict | None = None,
    long_range: str | None = None,
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
        long_range: for a model with long-range features, ``"p3m"`` (default:
            metatrain's evaluation; only the first structure of a call may be
            periodic) or ``"ewald"`` (metatrain's training; batches of crystals). See
            the module docstring.
    Returns:
        the path written.
    """
    from torch.export.pt2_archive._package import package_pt2

    method = _method(config, long_range)
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"the exported model's file name must end in .pt2, got {str(path)!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    device = torch.device(device)
    from petfunc.model.long_range import P3M_AOTI_CORRECT

    if aoti and method == "p3m" and not P3M_AOTI_CORRECT:
        raise ValueError(
            "AOTInductor of torch < 2.13 miscompiles the strain derivative of P3M "
            "long-range features (torch 2.11: wrong by about 100 %): export with "
            "aoti=False (--no-aoti), long_range='ewald', or torch >= 2.13"
        )
    aoti = default_aoti(device, config, long_range) if aoti is None else bool(aoti)
    program, example = trace(config, params, dtype, device, method)
    metadata = {
        "format": FORMAT,
        "version": VERSION if method else 2,
        "hypers": config.to_hypers(),
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
        "aoti": bool(aoti),
        "inputs": list(input_names(method)),
        "outputs": list(OUTPUTS),
        "torch": torch.__version__,
    }
    if method:
        metadata["long_range"] = method
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


def default_aoti(device, config: PETConfig | None = None, long_range: str | None = None) -> bool:
    """Whether :func:`export` builds the AOTInductor library when not told: on the CPU
    yes; on a GPU no (its one build tried so far crashed the loading process: see
    the module docstring); for a P3M long-range model on torch < 2.13 no (its
    AOTInductor miscompiles the strain derivative: :data:`petfunc.model.long_range.P3M_AOTI_CORRECT`)."""
    from petfunc.model.long_range import P3M_AOTI_CORRECT

    if config is not None and _method(config, long_range) == "p3m" and not P3M_AOTI_CORRECT:
        return False
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
            if any(size < 2 for d, size in enumerate(t.shape) if not _is_fixed(name, d)):
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


def load(path, aoti: bool | None = None) -> ExportedPET:
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
