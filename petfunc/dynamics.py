"""Batched molecular dynamics: ASE's velocity Verlet and Langevin integrators on many
structures at once.

Running many independent trajectories (sampling, active learning, screening at
temperature) one ASE ``Dynamics`` at a time pays one small model call per structure
and step. :func:`run` advances a list of structures together: every step evaluates
the forces of all of them in one batch (or in batches of at most ``max_atoms``
atoms), with one compiled graph for every batch shape when ``compile=True``. Each
structure follows exactly the update of ``ase.md.verlet.VelocityVerlet`` or
``ase.md.langevin.Langevin`` (same formulas, same order of random draws from its own
generator), so one structure run here takes the trajectory ASE's integrator takes
with :class:`petfunc.ase.PETCalculator`, to round-off. Constraints act as in ASE
(RATTLE-style: on the position update, then the momenta are recomputed).

Units are ASE's: ``timestep`` in ASE time units (``ase.units.fs``), temperatures in
Kelvin, ``friction`` in inverse ASE time units. Cells are fixed. Initial momenta are
those of the input atoms (for example from
``ase.md.velocitydistribution.MaxwellBoltzmannDistribution``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from ase import units
from ase.calculators.singlepoint import SinglePointCalculator
from tqdm import tqdm

from petfunc.ase import BatchEvaluator
from petfunc.config import PETConfig


__all__ = ["Langevin", "VelocityVerlet", "DynamicsResult", "run"]


@dataclass(frozen=True)
class VelocityVerlet:
    """NVE: ASE's ``VelocityVerlet`` update."""


@dataclass(frozen=True)
class Langevin:
    """NVT: ASE's ``Langevin`` update (Vanden-Eijnden and Ciccotti's propagator).

    Attributes:
        temperature_K: target temperature (K).
        friction: friction coefficient (inverse ASE time units, e.g. ``0.01 / units.fs``).
        fix_com: keep the centre of mass fixed, as ASE's ``fixcm`` (ASE's default is
            True, deprecated since ASE 3.28; here the default is False).
    """

    temperature_K: float
    friction: float
    fix_com: bool = False

    def __post_init__(self):
        if not self.temperature_K >= 0:
            raise ValueError(f"temperature_K must be >= 0, got {self.temperature_K!r}")
        if not self.friction >= 0:
            raise ValueError(f"friction must be >= 0, got {self.friction!r}")


@dataclass
class DynamicsResult:
    """What :func:`run` returns.

    Attributes:
        atoms: the final structures (copies), with their momenta and a
            ``SinglePointCalculator`` holding the final energy (eV) and forces (eV/Å).
        potential_energy, kinetic_energy: ``[steps + 1, n_structures]`` (eV) at every
            step, the initial state first.
        compiled_graphs: graphs compiled with ``compile=True`` (0 when eager).
    """

    atoms: list
    potential_energy: np.ndarray
    kinetic_energy: np.ndarray
    compiled_graphs: int = 0


class _Langevin:
    """One structure's Langevin coefficients and random stream (ASE's ``updatevars``)."""

    def __init__(self, atoms, dt: float, thermostat: Langevin, rng):
        self.masses = atoms.get_masses()[:, None]
        self.rng = rng
        self.fix_com = thermostat.fix_com
        temperature = units.kB * thermostat.temperature_K
        friction = thermostat.friction
        sigma = np.sqrt(2 * temperature * friction / self.masses)
        self.c1 = dt / 2.0 - dt * dt * friction / 8.0
        self.c2 = dt * friction / 2 - dt * dt * friction * friction / 8.0
        self.c3 = np.sqrt(dt) * sigma / 2.0 - dt**1.5 * friction * sigma / 8.0
        self.c5 = dt**1.5 * sigma / (2 * np.sqrt(3))
        self.c4 = friction / 2.0 * self.c5

    def kicks(self, atoms):
        """The random position and velocity increments of one step."""
        n = len(atoms)
        xi = self.rng.standard_normal(size=(n, 3))
        eta = self.rng.standard_normal(size=(n, 3))
        for constraint in atoms.constraints:
            if hasattr(constraint, "redistribute_forces_md"):
                constraint.redistribute_forces_md(atoms, xi, rand=True)
                constraint.redistribute_forces_md(atoms, eta, rand=True)
        rnd_pos = self.c5 * eta
        rnd_vel = self.c3 * xi - self.c4 * eta
        if self.fix_com:
            factor = np.sqrt(n / (n - 1.0))
            rnd_pos -= rnd_pos.sum(axis=0) / n
            rnd_vel -= (rnd_vel * self.masses).sum(axis=0) / (self.masses * n)
            rnd_pos *= factor
            rnd_vel *= factor
        return rnd_pos, rnd_vel


def run(
    config: PETConfig,
    params,
    frames: Sequence,
    steps: int,
    timestep: float,
    integrator=VelocityVerlet(),
    rngs: Sequence | None = None,
    seed: int = 0,
    max_atoms: int | None = None,
    compile: bool = False,
    backend="inductor",
    dtype: torch.dtype | None = None,
    device=None,
    observer: Callable[[int, list], None] | None = None,
    progress: bool = False,
    keep_freed_memory: bool = True,
) -> DynamicsResult:
    """Advance ``frames`` (``ase.Atoms``, not modified) by ``steps`` steps together.

    Args:
        config, params: the model.
        steps: number of steps.
        timestep: ASE time units (``2 * ase.units.fs``).
        integrator: :class:`VelocityVerlet` (default) or :class:`Langevin`.
        rngs: Langevin: one random generator per structure (anything with numpy's
            ``standard_normal``; pass the same ``np.random.default_rng(s)`` objects an
            ASE ``Langevin(..., rng=...)`` would get to reproduce it). Default:
            ``np.random.default_rng([seed, i])`` for structure i.
        max_atoms: most atoms in one model call (``None``: all at once).
        compile: evaluate through :func:`petfunc.compile` (one graph for every batch;
            long-range models: one per number of crystals in a batch).
        backend, dtype, device: as for :class:`petfunc.ase.PETCalculator`.
        observer: called as ``observer(step, atoms_list)`` after the initial
            evaluation (step 0) and after every step; each structure's calculator
            then holds its energy and forces (e.g. to write a trajectory).
        progress: show a tqdm bar of the steps.
        keep_freed_memory: as for :class:`petfunc.ase.batch.BatchEvaluator`.
    """
    _check_arguments(steps, timestep, integrator)
    evaluate = BatchEvaluator(
        config,
        params,
        max_atoms=max_atoms,
        compile=compile,
        backend=backend,
        dtype=dtype,
        device=device,
        cache_tag="petfunc.dynamics",
        keep_freed_memory=keep_freed_memory,
    )
    evaluate.check(frames)
    atoms_list = [atoms.copy() for atoms in frames]
    labels = [f"structure {i}" for i in range(len(atoms_list))]
    thermostats = _thermostats(atoms_list, timestep, integrator, rngs, seed)

    def evaluate_all():
        return _forces(atoms_list, evaluate(atoms_list, labels))

    potential = np.zeros((steps + 1, len(atoms_list)))
    kinetic = np.zeros((steps + 1, len(atoms_list)))
    forces = evaluate_all()
    _record(0, atoms_list, potential, kinetic, observer)
    bar = tqdm(total=steps, desc="MD", unit="step", disable=not progress)
    for step in range(1, steps + 1):
        # first half: every structure moves (ASE's order of operations), then one
        # batched force call, then the second half
        kicks = [_first_half(a, f, timestep, t) for a, f, t in zip(atoms_list, forces, thermostats)]
        forces = evaluate_all()
        for atoms, f, t, kick in zip(atoms_list, forces, thermostats, kicks):
            _second_half(atoms, f, timestep, t, kick)
        _record(step, atoms_list, potential, kinetic, observer)
        bar.update(1)
    bar.close()
    return DynamicsResult(atoms_list, potential, kinetic, evaluate.num_graphs)


def _forces(atoms_list, results) -> list:
    """Each structure's results as its calculator's (as PETCalculator would give them:
    ASE then applies the constraints), and its forces for the integrator."""
    forces = []
    for atoms, result in zip(atoms_list, results):
        atoms.calc = SinglePointCalculator(atoms, **result)
        forces.append(atoms.get_forces(md=True))
    return forces


def _record(step: int, atoms_list, potential: np.ndarray, kinetic: np.ndarray, observer) -> None:
    """The energies of ``step`` into ``potential`` and ``kinetic``; then the observer."""
    potential[step] = [a.get_potential_energy() for a in atoms_list]
    kinetic[step] = [a.get_kinetic_energy() for a in atoms_list]
    if observer is not None:
        observer(step, atoms_list)


def _thermostats(atoms_list, timestep: float, integrator, rngs, seed: int) -> list:
    """One Langevin thermostat per structure (with its random generator), or ``None``
    each for velocity Verlet."""
    if not isinstance(integrator, Langevin):
        return [None] * len(atoms_list)
    if rngs is None:
        rngs = [np.random.default_rng([seed, i]) for i in range(len(atoms_list))]
    if len(rngs) != len(atoms_list):
        raise ValueError(f"{len(rngs)} random generators for {len(atoms_list)} structures")
    return [_Langevin(a, timestep, integrator, r) for a, r in zip(atoms_list, rngs)]


def _check_arguments(steps, timestep, integrator) -> None:
    if int(steps) != steps or steps < 0:
        raise ValueError(f"steps must be a non-negative integer, got {steps!r}")
    if not timestep > 0:
        raise ValueError(f"timestep must be positive, got {timestep!r}")
    if not isinstance(integrator, (VelocityVerlet, Langevin)):
        raise TypeError(
            f"integrator must be petfunc.dynamics.VelocityVerlet() or Langevin(...), got {integrator!r}"
        )


def _first_half(atoms, forces: np.ndarray, timestep: float, thermostat: _Langevin | None):
    """The step of one structure up to the new force call, as ASE's integrator takes
    it: a half kick and the drift (velocity Verlet), or the Langevin propagator's
    first half. Returns what the second half needs (Langevin: the velocity after the
    constraints and the random kick)."""
    r = atoms.get_positions()
    if thermostat is None:
        masses = atoms.get_masses()[:, None]
        p = atoms.get_momenta() + 0.5 * timestep * forces
        atoms.set_positions(r + timestep * p / masses)
        if atoms.constraints:
            p = (atoms.get_positions() - r) * masses / timestep
        atoms.set_momenta(p, apply_constraint=False)
        return None
    t = thermostat
    rnd_pos, rnd_vel = t.kicks(atoms)
    v = atoms.get_velocities()
    v = v + (t.c1 * forces / t.masses - t.c2 * v + rnd_vel)
    atoms.set_positions(r + timestep * v + rnd_pos)
    # velocities after the constraints moved the positions
    v = (atoms.get_positions() - r - rnd_pos) / timestep
    return v, rnd_vel


def _second_half(atoms, forces: np.ndarray, timestep: float, thermostat: _Langevin | None, kick) -> None:
    """The rest of the step of one structure, with the new ``forces``."""
    if thermostat is None:
        atoms.set_momenta(atoms.get_momenta() + 0.5 * timestep * forces)
        return
    t = thermostat
    v, rnd_vel = kick
    v = v + (t.c1 * forces / t.masses - t.c2 * v + rnd_vel)
    atoms.set_momenta(v * t.masses)
