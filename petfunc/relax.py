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
every position update. Cells are fixed.

A structure stops when its largest atomic force is below ``fmax`` (ASE's test) or
after ``steps`` steps, and leaves the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence

import numpy as np
import torch

from .config import PETConfig
from .data import padding_sample
from .derivatives import energy_and_forces
from .io import cast_params, network_dtype
from .model import PET
from .structures import collate, prepare_atoms

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
            energy (eV) and forces (eV/Å, constraints applied).
        converged: whether the largest force fell below ``fmax``.
        steps: FIRE steps taken (model evaluations: ``steps + 1``).
        energies: final energies (eV).
        compiled_graphs: graphs compiled with ``compile=True`` (1 when no batch
            shape recompiled; 0 when eager).
    """

    atoms: list
    converged: List[bool]
    steps: List[int]
    energies: List[float]
    compiled_graphs: int = 0


class _State:
    """One structure's FIRE state (ASE's ``vel``, ``dt``, ``a``, ``Nsteps``)."""

    def __init__(self, atoms, parameters: FIRE):
        self.atoms = atoms
        self.vel = None
        self.dt = parameters.dt
        self.a = parameters.astart
        self.Nsteps = 0
        self.nsteps = 0
        self.done = False

    def step(self, forces: np.ndarray, p: FIRE) -> None:
        """ASE's ``FIRE.step`` (without its optional downhill check)."""
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
        self.atoms.set_positions(self.atoms.get_positions() + dr.reshape(-1, 3))


def fire(
    config: PETConfig,
    params,
    frames: Sequence,
    fmax: float = 0.05,
    steps: int = 1000,
    max_atoms: Optional[int] = None,
    compile: bool = False,
    backend="inductor",
    dtype: Optional[torch.dtype] = None,
    device=None,
    parameters: FIRE = FIRE(),
    progress: bool = False,
) -> RelaxResult:
    """Relax ``frames`` (``ase.Atoms``; not modified) with FIRE, all at once.

    Args:
        config, params: the model.
        fmax: convergence threshold on the largest atomic force (eV/Å).
        steps: most FIRE steps per structure.
        max_atoms: most atoms evaluated in one model call (``None``: every moving
            structure at once); bounds the memory of large sets.
        compile: evaluate through :func:`petfunc.compile` (one graph for every batch).
        backend, dtype, device: as for :class:`petfunc.ase.PETCalculator`.
        parameters: the :class:`FIRE` parameters.
        progress: show a tqdm bar of the structures still moving.
    """
    if not fmax > 0:
        raise ValueError(f"fmax must be positive, got {fmax!r}")
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if max_atoms is not None and max_atoms < 1:
        raise ValueError(f"max_atoms must be positive, got {max_atoms!r}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    dtype = dtype or network_dtype(params)
    params = cast_params(params, dtype, device)
    model = PET(config)
    padding = padding_sample(config).structure
    if compile:
        evaluate = None
    else:
        evaluate = energy_and_forces(model.energy, "autograd")

    states = [_State(atoms.copy(), parameters) for atoms in frames]
    for i, state in enumerate(states):
        if len(state.atoms) == 0:
            raise ValueError(f"structure {i} has no atoms")
    final = [None] * len(states)
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(states), desc="relaxed", unit="structure")
    while True:
        moving = [i for i, s in enumerate(states) if not s.done]
        if not moving:
            break
        for chunk in _chunks(moving, [len(states[i].atoms) for i in moving], max_atoms):
            structures = [prepare_atoms(states[i].atoms, config, label=f"structure {i}") for i in chunk]
            # the dummy molecule keeps every size >= 2: one compiled graph for all
            positions, cell, neighbors = collate(structures + [padding], config, dtype=dtype, device=device)
            if compile and evaluate is None:
                from .compile import compile as petfunc_compile

                evaluate = petfunc_compile(
                    energy_and_forces(model.energy), params, positions, cell, neighbors,
                    backend=backend, static_argnums=(0,),
                    cache_key=f"petfunc.relax energy_and_forces {config!r}",
                )
            with torch.no_grad():
                energies, forces = evaluate(params, positions, cell, neighbors)
            energies = energies.double().cpu().numpy()
            forces = forces.double().cpu().numpy()
            start = 0
            for k, i in enumerate(chunk):
                state = states[i]
                n = len(state.atoms)
                f = forces[start : start + n].copy()
                start += n
                for constraint in state.atoms.constraints:
                    constraint.adjust_forces(state.atoms, f)
                converged = np.linalg.norm(f, axis=1).max() < fmax
                if converged or state.nsteps >= steps:
                    state.done = True
                    final[i] = (float(energies[k]), f, bool(converged))
                    if bar is not None:
                        bar.update(1)
                    continue
                state.step(f, parameters)
                state.nsteps += 1
    if bar is not None:
        bar.close()

    from ase.calculators.singlepoint import SinglePointCalculator

    relaxed = []
    for state, (energy, forces, _) in zip(states, final):
        atoms = state.atoms
        atoms.calc = SinglePointCalculator(atoms, energy=energy, forces=forces)
        relaxed.append(atoms)
    return RelaxResult(
        atoms=relaxed,
        converged=[c for _, _, c in final],
        steps=[s.nsteps for s in states],
        energies=[e for e, _, _ in final],
        compiled_graphs=evaluate.num_graphs if compile and evaluate is not None else 0,
    )


def _chunks(indices: List[int], sizes: List[int], max_atoms: Optional[int]) -> List[List[int]]:
    """Consecutive groups of ``indices`` with at most ``max_atoms`` atoms each (a
    structure larger than that is a group of its own)."""
    if max_atoms is None:
        return [indices]
    groups, current, atoms = [], [], 0
    for index, size in zip(indices, sizes):
        if current and atoms + size > max_atoms:
            groups.append(current)
            current, atoms = [], 0
        current.append(index)
        atoms += size
    if current:
        groups.append(current)
    return groups

