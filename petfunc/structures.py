"""From ASE ``Atoms`` to PET inputs: ``positions, cell, neighbors = from_atoms(frames, config)``.

:class:`Structure` keeps one structure's numpy data and its flat edge list, so a
dataset computes neighbour lists once; :func:`collate` concatenates any set of them
into a batch and builds the batch's NEF grid. Both run eagerly: they are the only
place where shapes depend on the data.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from petfunc.config import PETConfig
from petfunc.graph import checks, frame
from petfunc.graph import long_range as long_range_inputs
from petfunc.graph import neighbors as nbl
from petfunc.model.adaptive import atomic_cutoffs
from petfunc.model.zbl import zbl_cutoff


@dataclass
class Structure:
    """One structure with its full neighbour list (all numpy, positions in Å)."""

    numbers: np.ndarray  # [n_atoms] atomic numbers
    species: np.ndarray  # [n_atoms] species indices
    positions: np.ndarray  # [n_atoms, 3]
    cell: np.ndarray  # [3, 3] rows; zero rows for non-periodic directions
    pbc: np.ndarray  # [3] bool
    centers: np.ndarray  # [n_edges]
    neighbors: np.ndarray  # [n_edges]
    shifts: np.ndarray  # [n_edges, 3]
    charge: int = 0  # total charge (elementary charges), for system conditioning
    spin_multiplicity: int = 1  # 2S + 1, for system conditioning

    def __len__(self) -> int:
        return len(self.numbers)


def list_cutoff(config: PETConfig) -> float:
    """Radius of the flat neighbour list: the PET cutoff, or the ZBL range if larger."""
    if config.zbl:
        return max(config.cutoff, zbl_cutoff(config))
    return config.cutoff


def _integer(value, name: str, label: str) -> int:
    array = np.asarray(value)
    if array.size != 1 or array.dtype.kind not in "iuf":  # bools are not charges
        raise ValueError(f"{label}: {name} must be one integer, got {value!r}")
    number = array.reshape(()).item()
    if not np.isfinite(number) or float(number) != round(float(number)):
        raise ValueError(f"{label}: {name} must be an integer, got {number!r}")
    return int(round(float(number)))


def system_state(charge, spin_multiplicity, config: PETConfig, label: str = "structure"):
    """Validated ``(charge, spin_multiplicity)`` of one structure for ``config``.

    ``None`` means the default (0 and 1). Models without ``system_conditioning``
    ignore both and get the defaults, as metatrain's do.

    Raises:
        ValueError: a non-integer value, or one outside the model's tables
            (``[-max_charge, max_charge]``, ``[1, max_spin_multiplicity]``).
    """
    if not config.system_conditioning:
        return 0, 1
    charge = 0 if charge is None else _integer(charge, "charge", label)
    spin = 1 if spin_multiplicity is None else _integer(spin_multiplicity, "spin multiplicity", label)
    if abs(charge) > config.max_charge:
        raise ValueError(
            f"{label}: charge {charge} is outside the model's range "
            f"[{-config.max_charge}, {config.max_charge}] (max_charge)"
        )
    if not 1 <= spin <= config.max_spin_multiplicity:
        raise ValueError(
            f"{label}: spin multiplicity {spin} is outside the model's range "
            f"[1, {config.max_spin_multiplicity}] (max_spin_multiplicity; it is 2S + 1)"
        )
    return charge, spin


#: ``atoms.info`` keys read for the charge and the spin multiplicity (in order), as
#: metatomic's ASE calculator reads them ("spin" is the OMol25 name)
CHARGE_KEYS = ("charge",)
SPIN_MULTIPLICITY_KEYS = ("spin_multiplicity", "spin")


def state_from_info(info, charge_key=None, spin_key=None):
    """``(charge, spin_multiplicity)`` as found in an ``atoms.info`` dict, ``None``
    where absent; :func:`prepare` validates them (and applies the defaults 0 and 1).

    ``charge_key``/``spin_key`` replace the default keys :data:`CHARGE_KEYS` and
    :data:`SPIN_MULTIPLICITY_KEYS`.
    """

    def first(keys):
        for key in keys:
            if key in info:
                return info[key]
        return None

    return first([charge_key] if charge_key else CHARGE_KEYS), first(
        [spin_key] if spin_key else SPIN_MULTIPLICITY_KEYS
    )


def prepare(
    numbers,
    positions,
    cell,
    pbc,
    config: PETConfig,
    label: str = "structure",
    charge=None,
    spin_multiplicity=None,
    wrap: bool = False,
) -> Structure:
    """Validate one structure and compute its neighbour list.

    ``charge`` and ``spin_multiplicity`` (2S+1) are the structure's total charge and
    spin state, read only by models with ``system_conditioning`` (defaults 0, 1).
    ``wrap`` moves the atoms into the cell along its periodic directions (in float64,
    by whole lattice vectors): the same structure, whose coordinates stay of the
    cell's size however far the atoms have diffused (the calculators ask for it
    with float32 models). Without it, :func:`collate` still moves each structure
    close to the origin before the cast (:mod:`petfunc.graph.frame`); the stored
    positions stay those given.

    Raises:
        ValueError: unknown species, NaN/inf positions, wrong shapes, a singular cell
            along a periodic direction, two atoms (or an atom and a periodic image of
            another) at the same place, no atoms, a charge or spin the model cannot
            represent, or a partly periodic structure for a long-range model.
    """
    numbers = np.asarray(numbers, dtype=np.int64).reshape(-1)
    positions = np.asarray(positions, dtype=np.float64)
    pbc = np.broadcast_to(np.asarray(pbc, dtype=bool), (3,)).copy()
    cell = np.zeros((3, 3)) if cell is None else np.array(cell, dtype=np.float64).reshape(3, 3)
    if len(numbers) == 0:
        raise ValueError(f"{label}: has no atoms")
    checks.check_structure(positions, cell, pbc, label)
    if positions.shape[0] != len(numbers):
        raise ValueError(f"{label}: {len(numbers)} atomic numbers but {positions.shape[0]} positions")
    try:
        species = nbl.species_index(numbers, config.atomic_types)
    except ValueError as error:
        raise ValueError(f"{label}: {error}") from None
    charge, spin_multiplicity = system_state(charge, spin_multiplicity, config, label)
    if config.long_range.enable:
        long_range_inputs.check_periodicity(pbc, label)
    cell[~pbc] = 0.0
    if wrap and pbc.any():
        positions = checks.wrapped(positions, cell, pbc)
    checks.check_density(positions, cell, pbc, list_cutoff(config), label)
    centers, neighbors, shifts = nbl.edge_list(positions, cell, pbc, list_cutoff(config))
    checks.check_coincident(positions, cell, centers, neighbors, shifts, label)
    return Structure(
        numbers, species, positions, cell, pbc, centers, neighbors, shifts, charge, spin_multiplicity
    )


def prepare_atoms(
    atoms, config: PETConfig, label: str = "structure", charge_key=None, spin_key=None, wrap: bool = False
) -> Structure:
    """:func:`prepare` for one ``ase.Atoms``; the charge and spin multiplicity of a
    conditioned model come from ``atoms.info`` (see :func:`state_from_info`)."""
    charge, spin = state_from_info(atoms.info, charge_key, spin_key)
    return prepare(
        atoms.get_atomic_numbers(),
        atoms.get_positions(),
        np.asarray(atoms.cell),
        atoms.pbc,
        config,
        label,
        charge=charge,
        spin_multiplicity=spin,
        wrap=wrap,
    )


def kept_edges(config: PETConfig, positions, cell, centers, neighbors, shifts, structure_index):
    """Ids of the flat edges PET keeps (``d <= cutoff``, or the adaptive pair radius).

    Evaluated eagerly in float64 with the same functions :func:`petfunc.model.energy`
    uses, so the set matches metatrain's masking at these positions.
    """
    if len(centers) == 0:
        return np.zeros(0, dtype=np.int64)
    pos = torch.as_tensor(positions, dtype=torch.float64)
    cells = torch.as_tensor(cell, dtype=torch.float64)
    c = torch.as_tensor(centers)
    n = torch.as_tensor(neighbors)
    s = torch.as_tensor(shifts, dtype=torch.float64)
    lattice = torch.einsum("ea,eab->eb", s, cells[torch.as_tensor(structure_index)[c]])
    d = torch.linalg.vector_norm(pos[n] - pos[c] + lattice, dim=-1) + 1e-15
    if config.adaptive:
        radii = atomic_cutoffs(config, c, d, len(positions))
        r_cut = 0.5 * (radii[c] + radii[n])
    else:
        r_cut = torch.full_like(d, config.cutoff)
    return torch.nonzero(d <= r_cut).reshape(-1).numpy()


def collate(
    structures: Sequence[Structure],
    config: PETConfig,
    dtype: torch.dtype | None = None,
    device=None,
    positions: Sequence[np.ndarray] | None = None,
    cells: Sequence[np.ndarray] | None = None,
    long_range: str = "p3m",
) -> tuple[torch.Tensor, torch.Tensor, nbl.Neighbors]:
    """Concatenate structures into ``(positions [n_atoms, 3], cell [n_structures, 3, 3],
    neighbors)``.

    The positions are in the model's frame (:mod:`petfunc.graph.frame`): each
    structure moved in float64, before the cast to ``dtype``, close to the origin (a
    translation, and lattice vectors for atoms more than a cell outside their cell,
    whose edges' ``cell_shifts`` change to match). The energy, forces and stress are
    those of the structures as given; a float32 batch does not lose digits to
    coordinates far from the origin.

    ``positions``/``cells`` optionally replace the stored geometry (e.g. rotated copies
    for augmentation); the edge list is reused, so they must be a rigid motion of it
    (a ``ValueError`` says which structure is not: build it again with :func:`prepare`).
    ``long_range`` picks the reciprocal-space method of a model with long-range
    features: ``"p3m"`` (metatrain's evaluation mode) or ``"ewald"`` (its training
    mode, and the one whose batches compile without recompiling).
    """
    if len(structures) == 0:
        raise ValueError("cannot build a batch from zero structures")
    dtype = dtype or torch.get_default_dtype()
    pos_list = list(positions) if positions is not None else [s.positions for s in structures]
    cell_list = list(cells) if cells is not None else [s.cell for s in structures]
    if len(pos_list) != len(structures) or len(cell_list) != len(structures):
        raise ValueError(
            f"collate: {len(pos_list)} positions and {len(cell_list)} cells for {len(structures)} "
            "structures; give one of each per structure"
        )
    offsets = np.cumsum([0] + [len(s) for s in structures])
    species = np.concatenate([s.species for s in structures])
    structure_index = np.repeat(np.arange(len(structures)), [len(s) for s in structures])
    centers = np.concatenate([s.centers + o for s, o in zip(structures, offsets)])
    neighbors = np.concatenate([s.neighbors + o for s, o in zip(structures, offsets)])
    frames = []
    for k, (s, pos, box) in enumerate(zip(structures, pos_list, cell_list)):
        if positions is not None or cells is not None:
            frame.check_rigid_motion(s.positions, pos, s.cell, box, s.pbc, f"structure {k}")
        # in float64, before the cast: a float32 batch keeps its digits
        frames.append(frame.model_frame(pos, box, s.pbc, s.centers, s.neighbors, s.shifts))
    shifts = np.concatenate([f[1] for f in frames]).reshape(-1, 3)
    all_positions = np.concatenate([f[0] for f in frames])
    all_cells = np.stack(cell_list).astype(np.float64)
    kept = kept_edges(config, all_positions, all_cells, centers, neighbors, shifts, structure_index)
    lr_inputs = None
    if config.long_range.enable:
        lr_inputs = long_range_inputs.build(
            config,
            [len(s) for s in structures],
            all_cells,
            np.stack([s.pbc for s in structures]),
            method=long_range,
            device=device,
        )
    graph = nbl.build(
        species,
        structure_index,
        centers,
        neighbors,
        shifts,
        kept,
        device=device,
        charge=np.array([s.charge for s in structures], dtype=np.int64),
        spin_multiplicity=np.array([s.spin_multiplicity for s in structures], dtype=np.int64),
        long_range=lr_inputs,
    )
    return (
        torch.as_tensor(all_positions, dtype=dtype, device=device),
        torch.as_tensor(all_cells, dtype=dtype, device=device),
        graph,
    )


# ---------------------------------------------------------------------------------------
# padding: no size of a batch is 0 or 1


_PADDING: dict[PETConfig, Structure] = {}


def padding_structure(config: PETConfig) -> Structure:
    """A 3-atom triangle (side 1 Å, of the first species) without labels, added to a
    batch so that none of its sizes (structures, atoms, edges, tokens, NEF width) is
    0 or 1: traced and compiled graphs specialise those sizes, so a batch that had
    one would need a graph of its own."""
    if config not in _PADDING:
        positions = np.array([[0.0, 0.0, 0.0], [1.0, 0.0, 0.0], [0.5, 0.8, 0.0]])
        numbers = [config.atomic_types[0]] * 3
        _PADDING[config] = prepare(numbers, positions, None, False, config, "padding")
    return _PADDING[config]


def needs_padding(structures: Sequence[Structure]) -> bool:
    """Whether a batch of ``structures`` could have a size below 2, judged by their flat
    neighbour lists (:func:`kept_graph_too_small` judges the edges PET keeps)."""
    if len(structures) < 2:
        return True
    if sum(len(s.centers) for s in structures) < 2:
        return True
    return max((np.bincount(s.centers).max() if len(s.centers) else 0) for s in structures) < 2


def kept_graph_too_small(neighbors: nbl.Neighbors) -> bool:
    """Whether a collated batch keeps fewer than 2 edges, or fewer than 2 in its fullest
    atom (PET's token count and NEF width, which the flat lists only bound: the cutoff,
    adaptive or not, may drop edges)."""
    return neighbors.kept_edges.shape[0] < 2 or neighbors.nef_index.shape[1] < 2


def collate_padded(
    structures: Sequence[Structure],
    config: PETConfig,
    always: bool = False,
    positions: Sequence[np.ndarray] | None = None,
    cells: Sequence[np.ndarray] | None = None,
    **options,
) -> tuple[torch.Tensor, torch.Tensor, nbl.Neighbors, bool]:
    """:func:`collate` with :func:`padding_structure` appended where a size could fall
    below 2 (or ``always``: then a batch of any content has the same structure count
    offset, which the calculators' compiled graphs rely on).

    Returns:
        ``(positions, cell, neighbors, padded)``; ``padded`` says whether the padding
        structure is the batch's last.
    """
    structures = list(structures)
    pad = padding_structure(config)

    def run(padded: bool):
        extra = [pad] if padded else []
        return collate(
            structures + extra,
            config,
            positions=None if positions is None else [*positions, *(p.positions for p in extra)],
            cells=None if cells is None else [*cells, *(p.cell for p in extra)],
            **options,
        )

    padded = always or needs_padding(structures)
    batch = run(padded)
    if not padded and kept_graph_too_small(batch[2]):
        padded = True
        batch = run(padded)
    return (*batch, padded)


def from_atoms(
    frames, config: PETConfig, dtype: torch.dtype | None = None, device=None, long_range: str = "p3m"
):
    """PET inputs for one ``ase.Atoms`` or a list of them.

    A model with ``system_conditioning`` reads each structure's total charge and spin
    multiplicity from ``atoms.info`` (see :func:`state_from_info`). ``long_range``
    is the reciprocal-space method of long-range models (see :func:`collate`).

    Returns:
        ``positions [n_atoms, 3]``, ``cell [n_structures, 3, 3]`` (dtype ``dtype`` or
        torch's default) and the integer :class:`~petfunc.graph.neighbors.Neighbors`.
        The positions are in the model's frame (see :func:`collate`): translated,
        in float64, close to the origin, so they may differ from ``atoms.positions``
        by a translation (and, for atoms more than a cell outside their cell, by
        lattice vectors). The neighbours are valid for these positions only: build
        them again whenever an atom moves (see :class:`~petfunc.graph.Neighbors`).
    """
    if not isinstance(frames, (list, tuple)):
        frames = [frames]
    structures: list[Structure] = [
        prepare_atoms(atoms, config, label=f"structure {i}") for i, atoms in enumerate(frames)
    ]
    return collate(structures, config, dtype=dtype, device=device, long_range=long_range)
