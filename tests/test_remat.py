"""Rematerialisation (petfunc.remat) and the calculator's memory options.

* the derivatives with recomputed transformer layers equal those without, to the
  bit (forces, strain derivative, per-atom energies; the parameter gradient of a
  force loss, a double backward), for both featurizers;
* autograd keeps fewer activations for the backward pass (counted exactly with a
  saved-tensor hook);
* torch.func, compile and exported models refuse it with a clear error;
* ``PETCalculator`` keeps freed memory by default, and not with ``remat``; so does the
  batched evaluator of ``relax.fire`` and ``dynamics.run``.
"""

import ase.build
import numpy as np
import pytest
import torch

import petfunc
from petfunc import allocator
from petfunc.ase import PETCalculator
from petfunc.derivatives import energy_terms_forces_strain_derivative
from petfunc.remat import saved_tensor_bytes
from petfunc.structures import collate, prepare_atoms


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2, num_attention_layers=2)


def config(featurizer="feedforward"):
    return petfunc.PETConfig(atomic_types=(1, 6, 8), featurizer_type=featurizer, **SMALL)


def structures():
    cell = ase.build.bulk("C", "diamond", a=3.567, cubic=True)
    cell.rattle(0.05, seed=2)
    molecule = ase.build.molecule("CH3CH2OH")
    molecule.rattle(0.05, seed=3)
    return [cell, molecule]


def inputs(cfg):
    return collate([prepare_atoms(atoms, cfg) for atoms in structures()], cfg, dtype=torch.float64)


@pytest.mark.parametrize("featurizer", ["feedforward", "residual"])
def test_remat_gives_the_same_derivatives(featurizer):
    cfg = config(featurizer)
    model = petfunc.PET(cfg)
    params = model.init(seed=4, dtype=torch.float64)
    positions, cell, neighbors = inputs(cfg)
    plain = energy_terms_forces_strain_derivative(model.energy_terms, "autograd")
    recomputed = energy_terms_forces_strain_derivative(petfunc.remat(model.energy_terms), "autograd")
    for a, b in zip(
        plain(params, positions, cell, neighbors), recomputed(params, positions, cell, neighbors)
    ):
        assert torch.equal(a, b)

    # training through autograd: the parameter gradient of a force loss differentiates
    # the recomputed layers twice
    def force_loss(fn):
        p = petfunc.tree.tree_map(lambda t: t.clone().requires_grad_(True), params)
        _, _, forces, _ = fn(p, positions, cell, neighbors)
        loss = (forces**2).sum()
        return torch.autograd.grad(loss, list(petfunc.tree.flatten(p).values()), allow_unused=True)

    for a, b in zip(force_loss(plain), force_loss(recomputed)):
        assert (a is None and b is None) or torch.equal(a, b)


def saved_bytes(fn, *args):
    """Bytes of the unique storages autograd saves for the backward pass of ``fn``."""
    return saved_tensor_bytes(fn, *args)[1]


def test_remat_keeps_fewer_activations():
    cfg = config()
    model = petfunc.PET(cfg)
    params = model.init(seed=4, dtype=torch.float64)
    positions, cell, neighbors = inputs(cfg)
    plain = saved_bytes(
        energy_terms_forces_strain_derivative(model.energy_terms, "autograd"),
        params,
        positions,
        cell,
        neighbors,
    )
    recomputed = saved_bytes(
        energy_terms_forces_strain_derivative(petfunc.remat(model.energy_terms), "autograd"),
        params,
        positions,
        cell,
        neighbors,
    )
    # 4 transformer layers keep their inputs only (here 7.8x fewer bytes; default PET 4.8x)
    assert recomputed < 0.25 * plain, (recomputed, plain)
    # after a remat function returns, nothing is recomputed any more
    again = saved_bytes(
        energy_terms_forces_strain_derivative(model.energy_terms, "autograd"),
        params,
        positions,
        cell,
        neighbors,
    )
    assert again == plain


def test_remat_refuses_torch_func_and_compile_and_runs_in_inference_mode():
    cfg = config()
    model = petfunc.PET(cfg)
    params = model.init(seed=4, dtype=torch.float64)
    positions, cell, neighbors = inputs(cfg)
    with pytest.raises(RuntimeError, match="torch.autograd only"):
        torch.func.grad(lambda x: petfunc.remat(model.energy)(params, x, cell, neighbors).sum())(positions)
    # inference mode is left for the derivative (autograd records nothing in it): remat works
    plain = energy_terms_forces_strain_derivative(model.energy_terms, "autograd")(
        params, positions, cell, neighbors
    )
    with torch.inference_mode():
        again = energy_terms_forces_strain_derivative(petfunc.remat(model.energy_terms), "autograd")(
            params, positions, cell, neighbors
        )
    for a, b in zip(plain, again):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="eager"):
        PETCalculator(cfg, params, remat=True, compile=True)
    # without gradients there is nothing to recompute: a plain forward pass
    with torch.no_grad():
        assert torch.equal(
            petfunc.remat(model.energy)(params, positions, cell, neighbors),
            model.energy(params, positions, cell, neighbors),
        )


def test_calculator_remat_and_freed_memory(monkeypatch):
    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda *a: calls.append(a) or True)
    cfg = config()
    params = petfunc.PET(cfg).init(seed=4, dtype=torch.float64)
    results = {}
    for remat, keep, expected_calls in [
        (False, None, 1),
        (True, None, 0),
        (False, False, 0),
        (True, True, 1),
    ]:
        calls.clear()
        calc = PETCalculator(cfg, params, remat=remat, keep_freed_memory=keep)
        assert len(calls) == expected_calls, (remat, keep)
        for index, atoms in enumerate(structures()):
            atoms.calc = calc
            values = [atoms.get_potential_energy(), atoms.get_forces(), atoms.get_potential_energies()]
            if atoms.pbc.all():
                values.append(atoms.get_stress())
            results.setdefault(index, []).append(values)
    for runs in results.values():
        for values in runs[1:]:
            for a, b in zip(runs[0], values):
                np.testing.assert_array_equal(a, b)
    # the batched evaluator of relax.fire and dynamics.run does the same by default
    from petfunc.ase import BatchEvaluator

    for keep, expected_calls in [(True, 1), (False, 0)]:
        calls.clear()
        BatchEvaluator(cfg, params, keep_freed_memory=keep)
        assert len(calls) == expected_calls
    calls.clear()
    petfunc.dynamics.run(cfg, params, structures(), steps=0, timestep=1.0, keep_freed_memory=False)
    assert not calls
