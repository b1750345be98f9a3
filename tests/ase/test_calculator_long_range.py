"""The ASE calculator and the batch evaluator with a long-range (P3M) PET, compiled:
equal to eager over MD-like moves and meshes of other sizes, with one graph per
layout of meshes."""

import ase
import ase.build
import numpy as np
import pytest

from tests.helpers.long_range import diamond, lr_config, molecule, perturbed_params, triclinic
from tests.helpers.patches import needs_patches


@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_compiled_calculator_follows_md_without_recompiling(backend):
    """The compiled calculator (P3M) equals eager over steps whose neighbour counts
    change, with one graph. With inductor this checks torch 2.11's P3M stress fault
    (README): a cell volume computed as inductor fuses it wrongly gives a stress off
    by about 100 %; petfunc's P3M computes it otherwise."""
    pytest.importorskip("ase")
    import petfunc.ase

    config = lr_config()
    params = perturbed_params(config)
    atoms = diamond()
    compiled = petfunc.ase.PETCalculator(config, params, compile=True, backend=backend)
    eager = petfunc.ase.PETCalculator(config, params)
    counts = set()
    for step in range(4):
        atoms.rattle(0.08, seed=10 + step)
        for calc in (compiled, eager):
            calc.calculate(atoms, ["energy", "forces", "stress"])
        _, _, neighbors = petfunc.from_atoms([atoms], config)
        counts.add(int(neighbors.centers.shape[0]))
        for key in ("energy", "forces", "stress"):
            a, b = np.asarray(compiled.results[key]), np.asarray(eager.results[key])
            assert np.abs(a - b).max() <= 1e-9 * max(1.0, np.abs(b).max()), key
    assert len(counts) > 1
    assert compiled.num_compilations == 1


@needs_patches("fft_meta")
def test_compiled_calculator_takes_any_mesh_and_molecules():
    """Cells whose P3M meshes differ (8 x 8 x 8, 16 x 8 x 8, 8 x 16 x 4) share one
    compiled graph: the traced FFTs keep the mesh sizes symbolic (petfunc.compile's
    FFT shape functions). A molecule (no mesh) gets a graph of its own, and a crystal
    after it reuses the first."""
    import petfunc.ase

    config = lr_config()
    params = perturbed_params(config)
    compiled = petfunc.ase.PETCalculator(config, params, compile=True, backend="aot_eager")
    eager = petfunc.ase.PETCalculator(config, params)
    larger = ase.build.bulk("C", "diamond", a=3.6, cubic=True).repeat((2, 1, 1))
    larger.rattle(0.05, seed=2)
    chain = ase.Atoms(
        "CO",
        positions=[[0.1, 0.2, 0.0], [0.3, -0.1, 0.95]],
        cell=[[5.0, 0.3, 0.0], [0.4, 5.5, 0.2], [0.1, 0.0, 1.9]],
        pbc=True,
    )
    graphs = []
    for atoms in (diamond(), larger, chain, molecule(), triclinic()):
        for calc in (compiled, eager):
            calc.calculate(atoms.copy(), ["energy", "forces"])
        for key in ("energy", "forces"):
            a, b = np.asarray(compiled.results[key]), np.asarray(eager.results[key])
            assert np.abs(a - b).max() <= 1e-9 * max(1.0, np.abs(b).max()), key
        graphs.append(compiled.num_compilations)
    assert graphs == [1, 1, 1, 2, 2]


# slow; the compiled P3M calculator tests above keep compiled long range in the
# default run
@pytest.mark.slow
def test_batch_evaluator_puts_crystals_first():
    """BatchEvaluator (batched relaxation and MD) with P3M: a graph is fixed to which
    structures of a call have a mesh, so the crystals go first and batches with as
    many crystals share a graph whatever their order; every result is the eager
    calculator's for its own structure."""
    import petfunc.ase
    from petfunc.ase import BatchEvaluator

    config = lr_config()
    params = perturbed_params(config)
    batched = BatchEvaluator(config, params, compile=True, backend="aot_eager")
    eager = petfunc.ase.PETCalculator(config, params)
    larger = ase.build.bulk("C", "diamond", a=3.6, cubic=True).repeat((2, 1, 1))
    larger.rattle(0.05, seed=2)
    graphs = []
    for frames in ([molecule(), diamond(), triclinic()], [diamond(), molecule(), larger], [molecule()]):
        results = batched(frames)
        for atoms, result in zip(frames, results):
            eager.calculate(atoms.copy(), ["energy", "forces"])
            for key in ("energy", "forces"):
                a, b = np.asarray(result[key]), np.asarray(eager.results[key])
                assert a.shape == b.shape and np.abs(a - b).max() <= 1e-9 * max(1.0, np.abs(b).max()), key
        graphs.append(batched.num_graphs)
    assert graphs == [1, 1, 2]
