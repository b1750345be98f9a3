"""One model call for many ``ase.Atoms``: the evaluation behind batched relaxation and
batched molecular dynamics.

:class:`BatchEvaluator` turns a list of structures into batches (all at once, or of
at most ``max_atoms`` atoms), adds the padding molecule that keeps every size >= 2,
and returns per-structure results as :class:`petfunc.ase.PETCalculator` computes
them: energy (eV), forces (eV/Å) and, when asked, the stress (eV/Å^3, ASE's Voigt
order, symmetrised). With ``compile=True`` one compiled graph serves every batch (for
a long-range model, one per number of crystals in a batch: each has its own P3M
mesh; the crystals are put first in the model call).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from petfunc import allocator
from petfunc.ase.calculator import _voigt, partly_periodic_stress_warning
from petfunc.config import PETConfig
from petfunc.data.samples import padding_sample
from petfunc.derivatives import energy_and_forces, energy_forces_strain_derivative
from petfunc.io.params import cast_params, network_dtype
from petfunc.model.long_range import calculator_backend, mesh_layout
from petfunc.model.pet import PET
from petfunc.structures import collate, prepare_atoms


__all__ = ["BatchEvaluator"]


def _check_frames(frames) -> None:
    """The batched APIs take a list of structures: one ``Atoms`` (a sequence of
    ``Atom``) failed with "object of type 'Atom' has no len()"."""
    import ase

    if isinstance(frames, ase.Atoms):
        raise TypeError("expected a list of ase.Atoms, got one Atoms; for one structure pass [atoms]")
    for i, atoms in enumerate(frames):
        if not isinstance(atoms, ase.Atoms):
            raise TypeError(f"expected a list of ase.Atoms, but item {i} is a {type(atoms).__name__}")


class BatchEvaluator:
    """``evaluator(atoms_list) -> [{"energy", "free_energy", "forces"[, "stress"]}, ...]``.

    Args:
        config, params: the model.
        stress: also compute the stress (every structure needs a cell of non-zero
            volume then).
        max_atoms: most atoms in one model call (``None``: all structures at once).
        compile: evaluate through :func:`petfunc.compile` (one graph for every batch;
            long-range models: one per number of crystals in a batch).
        backend, dtype, device: as for :class:`petfunc.ase.PETCalculator`.
        cache_tag: names the caller in the compiled trace's cache key.
        keep_freed_memory: call :func:`petfunc.allocator.keep_freed_memory`
            (process-wide), as the calculator does by default: each step reuses the
            memory the last one freed instead of page-faulting it in again.
    """

    def __init__(
        self,
        config: PETConfig,
        params,
        stress: bool = False,
        max_atoms: int | None = None,
        compile: bool = False,
        backend="inductor",
        dtype: torch.dtype | None = None,
        device=None,
        cache_tag: str = "petfunc.ase.batch",
        keep_freed_memory: bool = True,
    ):
        if max_atoms is not None and max_atoms < 1:
            raise ValueError(f"max_atoms must be positive, got {max_atoms!r}")
        if keep_freed_memory:
            allocator.keep_freed_memory()
        self.config = config
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.dtype = dtype or network_dtype(params)
        self.params = cast_params(params, self.dtype, self.device)
        self.stress = stress
        self.max_atoms = max_atoms
        self.compile = compile
        # GPUs on torch < 2.13: aot_eager for long-range models (long_range.calculator_backend)
        self.backend = calculator_backend(config, backend, self.device) if compile else backend
        self.cache_tag = cache_tag
        # with stress the model also gives dE/d strain, from the same pass
        self._derivatives = energy_forces_strain_derivative if stress else energy_and_forces
        self._model = PET(config)
        self._padding = padding_sample(config).structure
        self._warned = set()  # labels of the partly periodic structures warned about
        # by long-range mesh layout (long_range.mesh_layout): with P3M, one graph per
        # number of crystals in a batch; otherwise one in all
        self._compiled = {}
        self._eager = None if compile else self._derivatives(self._model.energy, "autograd")

    @property
    def num_graphs(self) -> int:
        """Graphs compiled so far (0 when eager)."""
        return sum(fn.num_graphs for fn in self._compiled.values())

    def check(self, frames: Sequence, labels: Sequence[str] | None = None) -> None:
        """Raise a ``ValueError`` naming the structure for an empty one, or (with
        stress) one whose cell has zero volume; with stress, warn (as
        :class:`~petfunc.ase.PETCalculator` does) for cells not periodic in all
        three directions."""
        _check_frames(frames)
        partly = []
        for i, atoms in enumerate(frames):
            label = labels[i] if labels is not None else f"structure {i}"
            if len(atoms) == 0:
                raise ValueError(f"{label} has no atoms")
            if self.stress and not abs(atoms.cell.volume) > 0.0:
                raise ValueError(
                    f"{label}: its cell has zero volume (pbc={atoms.pbc.tolist()}); the stress needs a "
                    "periodic cell"
                )
            if self.stress and not np.all(atoms.pbc):
                partly.append(label)
        partly = [label for label in partly if label not in self._warned]
        if partly:
            # once per evaluator and structure: relax.fire and dynamics.run check
            # before their first step (the warning then names the caller's line),
            # and every call, on the structures still moving, checks again
            self._warned.update(partly)
            named = ", ".join(partly[:3]) + (f" and {len(partly) - 3} more" if len(partly) > 3 else "")
            warnings.warn(partly_periodic_stress_warning(named), stacklevel=3)

    def __call__(self, frames: Sequence, labels: Sequence[str] | None = None) -> list[dict[str, np.ndarray]]:
        _check_frames(frames)
        labels = list(labels) if labels is not None else [f"structure {i}" for i in range(len(frames))]
        self.check(frames, labels)
        results: list[dict[str, np.ndarray] | None] = [None] * len(frames)
        for group in _chunks([len(a) for a in frames], self.max_atoms):
            if self.compile and self.config.long_range.enable:
                # crystals first: a P3M graph is fixed to which structures have a
                # mesh, so k crystals and any molecules then share one graph
                group = sorted(group, key=lambda i: not frames[i].pbc.any())
            # float32 models: atoms wrapped into the cell in float64 (as PETCalculator)
            wrap = self.dtype != torch.float64
            structures = [prepare_atoms(frames[i], self.config, label=labels[i], wrap=wrap) for i in group]
            # the dummy molecule keeps every size >= 2: one compiled graph for all
            positions, cell, neighbors = collate(
                structures + [self._padding], self.config, dtype=self.dtype, device=self.device
            )
            with torch.no_grad():
                outputs = self._evaluate(positions, cell, neighbors)
            energies = outputs[0].double().cpu().numpy()
            forces = outputs[1].double().cpu().numpy()
            strain = outputs[2].double().cpu().numpy() if self.stress else None
            start = 0
            for k, i in enumerate(group):
                n = len(frames[i])
                result = {
                    "energy": float(energies[k]),
                    "free_energy": float(energies[k]),
                    "forces": forces[start : start + n].copy(),
                }
                if strain is not None:
                    result["stress"] = _voigt(strain[k] / abs(frames[i].cell.volume))
                start += n
                results[i] = result
        return results

    def _evaluate(self, positions, cell, neighbors):
        if not self.compile:
            return self._eager(self.params, positions, cell, neighbors)
        layout = mesh_layout(neighbors.long_range)
        if layout not in self._compiled:
            from petfunc.compile import compile as petfunc_compile

            self._compiled[layout] = petfunc_compile(
                self._derivatives(self._model.energy),
                self.params,
                positions,
                cell,
                neighbors,
                backend=self.backend,
                static_argnums=(0,),
                cache_key=f"{self.cache_tag} {self._derivatives.__name__} {self.config!r}",
                keep_freed_memory=False,  # decided by this object's own option
                aot_autograd=True,  # AOTAutograd's cache: faster warm starts, which calculators mostly have
            )
        return self._compiled[layout](self.params, positions, cell, neighbors)


def _chunks(sizes: list[int], max_atoms: int | None) -> list[list[int]]:
    """Consecutive groups of structure indices with at most ``max_atoms`` atoms each
    (a structure larger than that is a group of its own)."""
    if max_atoms is None:
        return [list(range(len(sizes)))]
    groups, current, atoms = [], [], 0
    for index, size in enumerate(sizes):
        if current and atoms + size > max_atoms:
            groups.append(current)
            current, atoms = [], 0
        current.append(index)
        atoms += size
    if current:
        groups.append(current)
    return groups
