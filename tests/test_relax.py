"""Batched FIRE (petfunc.relax.fire) against ASE's FIRE with the petfunc calculator."""

import ase.build
import numpy as np
import pytest
import torch
from ase.constraints import FixAtoms
from ase.filters import FrechetCellFilter, UnitCellFilter
from ase.optimize import FIRE as AseFIRE

import petfunc
from petfunc.ase import PETCalculator
from petfunc.relax import FIRE, fire


CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 8, 29),
    cutoff=4.0,
    d_pet=8,
    d_head=8,
    d_node=16,
    d_feedforward=16,
    num_heads=2,
    num_gnn_layers=1,
    num_attention_layers=1,
)


@pytest.fixture(scope="module")
def params():
    params = petfunc.PET(CONFIG).init(seed=3, dtype=torch.float64)
    params["energy_scale"].fill_(3.0)  # a landscape with some curvature
    return params


def _structures():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.1, seed=1)
    water = ase.build.molecule("H2O")
    water.rattle(0.1, seed=2)
    copper = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True)
    copper.rattle(0.08, seed=3)
    methanol = ase.build.molecule("CH3OH")
    methanol.rattle(0.1, seed=4)
    methanol.set_constraint(FixAtoms(indices=[0, 1]))
    return [ethanol, water, copper, methanol]


@pytest.mark.parametrize("max_atoms", [None, 12])
def test_fire_follows_ase(params, max_atoms):
    """Every structure, relaxed in one batch (or batches of at most 12 atoms), takes
    the steps ASE's FIRE takes with PETCalculator, to round-off: same step count and
    convergence, positions to 1e-7 Å, constraints respected."""
    frames = _structures()
    result = fire(CONFIG, params, frames, fmax=0.02, steps=150, max_atoms=max_atoms)
    for atoms, relaxed, converged, steps in zip(frames, result.atoms, result.converged, result.steps):
        reference = atoms.copy()
        reference.calc = PETCalculator(CONFIG, params)
        optimizer = AseFIRE(reference, logfile=None)
        ase_converged = optimizer.run(fmax=0.02, steps=150)
        assert steps == optimizer.nsteps and converged == ase_converged, (steps, optimizer.nsteps)
        assert steps > 5
        np.testing.assert_allclose(relaxed.positions, reference.positions, atol=1e-7)
        assert relaxed.get_potential_energy() == pytest.approx(reference.get_potential_energy(), abs=1e-9)
        np.testing.assert_allclose(relaxed.get_forces(), reference.get_forces(), atol=1e-8)
        assert relaxed is not atoms and not np.array_equal(relaxed.positions, atoms.positions)
    fixed = result.atoms[3]
    np.testing.assert_array_equal(fixed.positions[:2], frames[3].positions[:2])
    assert np.all(result.atoms[3].get_forces()[:2] == 0.0)


def _cells():
    copper = ase.build.bulk("Cu", "fcc", a=3.7, cubic=True)
    copper.set_cell(
        copper.cell[:] @ np.array([[1.0, 0.02, 0.0], [0.0, 0.97, 0.01], [0.0, 0.0, 1.03]]), scale_atoms=True
    )
    copper.rattle(0.05, seed=5)
    diamond = ase.build.bulk("C", "diamond", a=3.5)
    diamond.rattle(0.05, seed=6)
    mixed = ase.build.bulk("Cu", "fcc", a=3.6) * (2, 1, 1)
    mixed.symbols[1] = "O"
    mixed.rattle(0.05, seed=7)
    mixed.set_constraint(FixAtoms(indices=[0]))
    return [copper, diamond, mixed]


@pytest.mark.parametrize(
    "cell_filter",
    [FrechetCellFilter, lambda atoms: UnitCellFilter(atoms, scalar_pressure=0.01, hydrostatic_strain=True)],
    ids=["frechet", "unitcell-pressure-hydrostatic"],
)
def test_fire_with_cell_filter_follows_ase(params, cell_filter):
    """Variable-cell relaxation: each structure, in one batch, takes the steps of
    ASE's ``FIRE(filter(atoms))`` with PETCalculator (same steps, convergence,
    positions and cells to round-off); a fixed atom only follows the cell."""
    frames = _cells()
    result = fire(CONFIG, params, frames, fmax=0.005, steps=100, cell_filter=cell_filter)
    for atoms, relaxed, converged, steps in zip(frames, result.atoms, result.converged, result.steps):
        reference = atoms.copy()
        reference.calc = PETCalculator(CONFIG, params)
        optimizer = AseFIRE(cell_filter(reference), logfile=None)
        ase_converged = optimizer.run(fmax=0.005, steps=100)
        assert steps == optimizer.nsteps and converged == ase_converged, (steps, optimizer.nsteps)
        assert steps > 5
        assert not np.allclose(relaxed.cell[:], atoms.cell[:], atol=1e-3)  # the cell moved
        np.testing.assert_allclose(relaxed.cell[:], reference.cell[:], atol=1e-7)
        np.testing.assert_allclose(relaxed.positions, reference.positions, atol=1e-7)
        assert relaxed.get_potential_energy() == pytest.approx(reference.get_potential_energy(), abs=1e-9)
        np.testing.assert_allclose(relaxed.get_stress(), reference.get_stress(), atol=1e-9)
    fixed = result.atoms[2]
    np.testing.assert_allclose(
        fixed.get_scaled_positions()[0], frames[2].get_scaled_positions()[0], atol=1e-12
    )
    assert np.all(fixed.get_forces()[0] == 0.0)


def test_fire_cell_filter_needs_a_cell(params):
    with pytest.raises(ValueError, match="structure 1: its cell has zero volume"):
        fire(CONFIG, params, [_cells()[0], ase.build.molecule("H2O")], cell_filter=FrechetCellFilter)


def test_partly_periodic_stress_warns(params):
    """As PETCalculator, the batched evaluator (relaxation, MD) warns that a slab's
    stress uses the ASE cell volume; a bulk cell does not."""
    import warnings

    from petfunc.ase import BatchEvaluator

    slab = _cells()[0].copy()
    slab.pbc = [True, True, False]
    evaluate = BatchEvaluator(CONFIG, params, stress=True)
    with pytest.warns(
        UserWarning, match="stress requested but likely to be wrong for structure 1: not periodic"
    ):
        evaluate([_cells()[0], slab])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        evaluate([_cells()[0]])
    # once per evaluator and structure (relax.fire checks before its first step, and
    # every step, on the structures still moving, checks again): one warning, even
    # when all are shown
    for warned_before in (True, False):
        evaluate = evaluate if warned_before else BatchEvaluator(CONFIG, params, stress=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            evaluate.check([_cells()[0], slab, slab])
            evaluate([_cells()[0], slab, slab])
            evaluate([slab], labels=["structure 2"])  # the others converged
        assert len(caught) == 1, [str(w.message) for w in caught]
        assert (
            "for structure 2" in str(caught[0].message)
            if warned_before
            else "for structure 1, structure 2" in str(caught[0].message)
        )


def test_fire_compiled_one_graph(params):
    """Compiled: one graph while the batch shrinks from 4 structures to 1."""
    pytest.importorskip("torch._dynamo")
    frames = _structures()
    eager = fire(CONFIG, params, frames, fmax=0.02, steps=60)
    compiled = fire(CONFIG, params, frames, fmax=0.02, steps=60, compile=True, backend="aot_eager")
    assert compiled.steps == eager.steps
    assert compiled.compiled_graphs == 1 and eager.compiled_graphs == 0
    for a, b in zip(compiled.atoms, eager.atoms):
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-7)
    cells = _cells()
    eager = fire(CONFIG, params, cells, fmax=0.02, steps=20, cell_filter=FrechetCellFilter)
    compiled = fire(
        CONFIG,
        params,
        cells,
        fmax=0.02,
        steps=20,
        cell_filter=FrechetCellFilter,
        compile=True,
        backend="aot_eager",
    )
    assert compiled.steps == eager.steps and compiled.compiled_graphs == 1
    for a, b in zip(compiled.atoms, eager.atoms):
        np.testing.assert_allclose(a.cell[:], b.cell[:], atol=1e-7)
        np.testing.assert_allclose(a.positions, b.positions, atol=1e-7)


def test_fire_stops_at_steps_and_checks_arguments(params):
    frames = _structures()[:2]
    result = fire(CONFIG, params, frames, fmax=1e-6, steps=3, parameters=FIRE(dt=0.05))
    assert result.steps == [3, 3] and result.converged == [False, False]
    for bad, message in (({"fmax": 0}, "fmax"), ({"steps": -1}, "steps"), ({"max_atoms": 0}, "max_atoms")):
        with pytest.raises(ValueError, match=message):
            fire(CONFIG, params, frames, **bad)
    with pytest.raises(ValueError, match=r"structure 0: atomic number\(s\) \[7\] are not among"):
        fire(CONFIG, params, [ase.build.molecule("NH3")])
    # one Atoms instead of a list is named as such (not "object of type 'Atom' has no len()")
    from petfunc.ase import BatchEvaluator
    from petfunc.dynamics import run

    for call in (
        lambda f: fire(CONFIG, params, f),
        lambda f: BatchEvaluator(CONFIG, params)(f),
        lambda f: run(CONFIG, params, f, steps=1, timestep=0.5),
    ):
        with pytest.raises(TypeError, match=r"got one Atoms; for one structure pass \[atoms\]"):
            call(frames[0])
        with pytest.raises(TypeError, match="item 1 is a str"):
            call([frames[0], "H2O"])


def test_fire_float32_far_from_the_origin(params):
    """A molecule at 1e6 Å relaxes in float32 as it does at the origin in float64, and
    comes back at 1e6 Å (the user's frame); its input is not modified."""
    near = _structures()[0]
    far = near.copy()
    far.positions += [1e6, 0.0, 0.0]
    given = far.positions.copy()
    params32 = petfunc.tree.tree_map(lambda x: x.float(), params)
    reference = fire(CONFIG, params, [near], steps=8).atoms[0]
    relaxed = fire(CONFIG, params32, [far], steps=8).atoms[0]
    np.testing.assert_allclose(relaxed.positions - [1e6, 0.0, 0.0], reference.positions, rtol=0, atol=1e-5)
    assert np.array_equal(far.positions, given)
