"""Batched geometry optimisation: ASE's FIRE on many structures at once.

High-throughput relaxations (screening, dataset generation) spend most of their time
in many small model calls, one per structure and step. :func:`fire` relaxes a list
of structures together: at each step the structures still moving are evaluated in
one batch (or in batches of at most ``max_atoms`` atoms), with one compiled function
for every batch shape when ``compile=True``, and each structure takes its own FIRE
step. The FIRE update is ASE's (``ase.optimize.FIRE``, same parameters and
defaults), so one structure relaxed here follows the trajectory ASE's optimiser
takes with :class:`petfunc.ase.PETCalculator`, to round-off. Constraints
(``FixAtoms`` and the like) act as in ASE: on the forces the optimiser sees and on
every position update.

Cells are fixed unless ``cell_filter`` is given: an ASE filter class (or any callable
``atoms -> filter``), such as ``ase.filters.FrechetCellFilter`` or
``functools.partial(FrechetCellFilter, scalar_pressure=p)``. FIRE then moves what the
filter exposes (positions and cell deformation), exactly as
``FIRE(FrechetCellFilter(atoms))`` does in ASE; the batched model call gives the
stress the filter needs.

A structure stops when its largest (generalised) force is below ``fmax`` (ASE's
test: for a cell filter the cell rows count as three more "atoms") or after ``steps``
steps, and leaves the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from ase.calculators.singlepoint import SinglePointCalculator
from tqdm import tqdm

from petfunc.ase import BatchEvaluator
from petfunc.config import PETConfig


__all__ = ["FIRE", "RelaxResult", "fire"]


@dataclass(frozen=True)
class FIRE:
    """ASE's FIRE parameters and defaults (``ase.optimize.FIRE``): time step ``dt``
    (ASE's units, Å sqrt(amu/eV)), largest step ``maxstep`` (Å), ``dtmax``, ``Nmin``,
    ``finc``, ``fdec``, ``astart``, ``fa``."""

    dt: float = 0.1
    maxstep: float = 0.2
    dtmax: float = 1.0
    Nmin: int = 5
    finc: float = 1.1
    fdec: float = 0.5
    astart: float = 0.1
    fa: float = 0.99


@dataclass
class RelaxResult:
    """What :func:`fire` returns, one entry per input structure, in input order.

    Attributes:
        atoms: relaxed copies, each with a ``SinglePointCalculator`` holding the final
            energy (eV), forces (eV/Å; ``get_forces()`` applies the constraints) and,
            with a cell filter, stress (eV/Å^3, ASE's Voigt order).
        converged: whether the largest force fell below ``fmax``.
        steps: FIRE steps taken (model evaluations: ``steps + 1``).
        energies: final energies (eV).
        compiled_graphs: graphs compiled with ``compile=True`` (1 when no batch
            shape recompiled; 0 when eager).
    """

    atoms: list
    converged: list[bool]
    steps: list[int]
    energies: list[float]
    compiled_graphs: int = 0


class _State:
    """One structure's FIRE state (ASE's ``vel``, ``dt``, ``a``, ``Nsteps``) and what
    it moves: the atoms, or a cell filter wrapping them (``optimised``)."""

    def __init__(self, atoms, parameters: FIRE, cell_filter=None):
        self.atoms = atoms
        self.optimised = atoms if cell_filter is None else cell_filter(atoms)
        self.vel = None
        self.dt = parameters.dt
        self.a = parameters.astart
        self.Nsteps = 0
        self.nsteps = 0
        self.done = False

    def step(self, forces: np.ndarray, p: FIRE) -> None:
        """ASE's ``FIRE.step`` (without its optional downhill check); ``forces`` are
        the generalised forces of :attr:`optimised`."""
        gradient = forces.reshape(-1)
        if self.vel is None:
            self.vel = np.zeros(gradient.shape)
        else:
            vf = np.vdot(gradient, self.vel)
            grad2 = np.vdot(gradient, gradient)
            if vf > 0.0:
                self.vel = (1.0 - self.a) * self.vel + self.a * gradient / np.sqrt(grad2) * np.sqrt(
                    np.vdot(self.vel, self.vel)
                )
                if self.Nsteps > p.Nmin:
                    self.dt = min(self.dt * p.finc, p.dtmax)
                    self.a *= p.fa
                self.Nsteps += 1
            else:
                self.vel[:] *= 0.0
                self.a = p.astart
                self.dt *= p.fdec
                self.Nsteps = 0
        self.vel += self.dt * gradient
        dr = self.dt * self.vel
        normdr = np.sqrt(np.vdot(dr, dr))
        if normdr > p.maxstep:
            dr = p.maxstep * dr / normdr
        # set_positions applies the atoms' constraints, as ASE's optimisable does
        # (a filter's deforms the cell and then sets the positions)
        self.optimised.set_positions(self.optimised.get_positions() + dr.reshape(-1, 3))


def fire(
    config: PETConfig,
    params,
    frames: Sequence,
    fmax: float = 0.05,
    steps: int = 1000,
    max_atoms: int | None = None,
    compile: bool = False,
    backend="inductor",
    dtype: torch.dtype | None = None,
    device=None,
    parameters: FIRE = FIRE(),
    cell_filter=None,
    progress: bool = False,
    keep_freed_memory: bool = True,
) -> RelaxResult:
    """Relax ``frames`` (``ase.Atoms``; not modified) with FIRE, all at once.

    Args:
        config, params: the model.
        fmax: convergence threshold on the largest atomic force (eV/Å).
        steps: most FIRE steps per structure.
        max_atoms: most atoms evaluated in one model call (``None``: every moving
            structure at once); bounds the memory of large sets.
        compile: evaluate through :func:`petfunc.compile` (one graph for every batch;
            long-range models: one per number of crystals in a batch).
        backend, dtype, device: as for :class:`petfunc.ase.PETCalculator`.
        parameters: the :class:`FIRE` parameters.
        cell_filter: relax the cells too, through this ASE filter (e.g.
            ``ase.filters.FrechetCellFilter``; a callable ``atoms -> filter``). Every
            structure must then have a cell of non-zero volume.
        progress: show a tqdm bar of the structures still moving.
        keep_freed_memory: as for :class:`petfunc.ase.batch.BatchEvaluator`.
    """
    if not fmax > 0:
        raise ValueError(f"fmax must be positive, got {fmax!r}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    evaluate = BatchEvaluator(
        config,
        params,
        stress=cell_filter is not None,
        max_atoms=max_atoms,
        compile=compile,
        backend=backend,
        dtype=dtype,
        device=device,
        cache_tag="petfunc.relax",
        keep_freed_memory=keep_freed_memory,
    )
    evaluate.check(frames)
    states = [_State(atoms.copy(), parameters, cell_filter) for atoms in frames]
    final = [None] * len(states)
    bar = tqdm(total=len(states), desc="relaxed", unit="structure", disable=not progress)
    while True:
        moving = [i for i, s in enumerate(states) if not s.done]
        if not moving:
            break
        results = evaluate([states[i].atoms for i in moving], [f"structure {i}" for i in moving])
        for i, result in zip(moving, results):
            final[i] = _advance(states[i], result, fmax, steps, parameters)
            if states[i].done:
                bar.update(1)
    bar.close()

    # each structure's calculator holds the results at its final positions and cell
    return RelaxResult(
        atoms=[s.atoms for s in states],
        converged=final,
        steps=[s.nsteps for s in states],
        energies=[s.atoms.get_potential_energy() for s in states],
        compiled_graphs=evaluate.num_graphs,
    )


def _advance(state: _State, result: dict, fmax: float, steps: int, parameters: FIRE) -> bool | None:
    """Give ``state`` its evaluated ``result`` and take a FIRE step, unless it has
    converged or used its ``steps``; returns whether it converged once done (else
    ``None``)."""
    # the results, as PETCalculator would give them: the atoms (and a filter through
    # them) then apply constraints and make cell forces as ASE does
    state.atoms.calc = SinglePointCalculator(state.atoms, **result)
    f = state.optimised.get_forces()
    converged = np.linalg.norm(f.reshape(-1, 3), axis=1).max() < fmax
    if converged or state.nsteps >= steps:
        state.done = True
        return bool(converged)
    state.step(f, parameters)
    state.nsteps += 1
    return None
