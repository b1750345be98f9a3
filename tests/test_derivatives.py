"""``autodiff="autograd"`` (eager torch.autograd) gives the derivatives of
``autodiff="func"`` (torch.func): forces, stress, per-atom energies, the parameter
gradient of the loss (a grad of a grad) and the training step, float64; it refuses
to run where it would be traced or transformed."""

import ase
import ase.build
import pytest
import torch
from ase.calculators.emt import EMT
from torch.fx.experimental.proxy_tensor import make_fx

import petfunc
from petfunc.data import make_batch, sample_from_atoms
from petfunc.derivatives import (
    energy_and_forces,
    energy_forces_strain_derivative,
    energy_forces_stress,
    energy_terms_forces_strain_derivative,
    forces,
)
from petfunc.hessian import hvp
from tests.helpers.patches import needs_patches


F64 = torch.float64
# adaptive cutoff on: its radii depend on positions, and both paths must see that
CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 8, 13, 29),
    d_pet=8,
    d_node=16,
    d_head=8,
    d_feedforward=16,
    num_heads=2,
    num_neighbors_adaptive=6,
)


def _frames():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    cell = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    cell.rattle(0.1, seed=2)
    return [ethanol, cell]


def _params(seed=0):
    params = petfunc.PET(CONFIG).init(seed=seed, dtype=F64)
    params["composition_weights"] = torch.linspace(-3.0, 2.0, 5, dtype=F64)
    params["energy_scale"] = torch.tensor(0.7, dtype=F64)
    return params


def _close(a, b, rtol=1e-12):
    scale = b.abs().max().clamp_min(1e-300)
    assert ((a - b).abs().max() / scale).item() <= rtol


def test_inference_derivatives_agree():
    model = petfunc.PET(CONFIG)
    params = _params()
    inputs = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
    for make in (energy_and_forces, energy_forces_strain_derivative, energy_forces_stress, forces):
        a = make(model.energy, "func")(params, *inputs)
        b = make(model.energy, "autograd")(params, *inputs)
        for x, y in zip(a if isinstance(a, tuple) else (a,), b if isinstance(b, tuple) else (b,)):
            torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-14, equal_nan=True)
            # nothing required grad: no graph is kept alive
            assert not y.requires_grad
    a = energy_terms_forces_strain_derivative(model.energy_terms)(params, *inputs)
    b = energy_terms_forces_strain_derivative(model.energy_terms, "autograd")(params, *inputs)
    for x, y in zip(a, b):
        _close(y, x)


def test_autograd_path_under_no_grad_and_inference_mode():
    model = petfunc.PET(CONFIG)
    params = _params()
    inputs = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
    expected = energy_forces_stress(model.energy)(params, *inputs)
    for context in (torch.no_grad, torch.inference_mode):
        with context():
            for make in (energy_forces_stress, energy_and_forces):
                out = make(model.energy, "autograd")(params, *inputs)
                for x, y in zip(expected, out):
                    torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-14, equal_nan=True)
    # inputs made in inference mode (inference tensors), both autodiff modes
    with torch.inference_mode():
        made_inside = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
        params_inside = petfunc.tree.tree_map(torch.clone, params)
        for autodiff in ("func", "autograd"):
            out = energy_forces_stress(model.energy, autodiff)(params_inside, *made_inside)
            for x, y in zip(expected, out):
                torch.testing.assert_close(y, x, rtol=1e-12, atol=1e-14, equal_nan=True)


@needs_patches("layer_norm_decomposition")
def test_autograd_derivatives_are_differentiable_when_needed():
    """With positions requiring grad the autograd forces carry a graph: their
    derivative is the Hessian-vector product of the torch.func path."""
    model = petfunc.PET(CONFIG)
    params = _params()
    positions, cell, neighbors = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
    v = torch.randn(positions.shape, dtype=F64, generator=torch.Generator().manual_seed(0))
    x = positions.clone().requires_grad_(True)
    f = forces(model.energy, "autograd")(params, x, cell, neighbors)
    (hv,) = torch.autograd.grad(-(f * v).sum(), x)
    expected = hvp(model.energy)(params, positions, cell, neighbors, v)
    _close(hv, expected, 1e-11)


def _batch():
    samples = []
    for k in range(3):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 1 + k % 2))
        atoms.numbers[[1]] = 13
        atoms.rattle(0.1, seed=k)
        atoms.calc = EMT()
        atoms.get_stress()
        samples.append(sample_from_atoms(atoms, CONFIG))
    return make_batch(samples, CONFIG, [0.0, 0.0, 0.0, -0.1, -0.2], 0.5, dtype=F64)


@pytest.mark.parametrize("terms", [(1.0, 0.0, 0.0), (1.0, 2.0, 0.0), (1.0, 2.0, 0.5)], ids=["E", "EF", "EFS"])
def test_parameter_gradients_agree(terms):
    model = petfunc.PET(CONFIG)
    params = _params(seed=1)
    batch = _batch()
    weights = petfunc.LossWeights.make(*terms)
    g_func, m_func = petfunc.make_grad_step(model, weights)(params, batch)
    g_auto, m_auto = petfunc.make_grad_step(model, weights, autodiff="autograd")(params, batch)
    assert set(m_func) == set(m_auto)
    for key in m_func:
        torch.testing.assert_close(m_auto[key], m_func[key], rtol=1e-12, atol=1e-14)
    a, b = petfunc.tree.flatten(g_func), petfunc.tree.flatten(g_auto)
    assert a.keys() == b.keys()
    for key in a:
        _close(b[key], a[key], 1e-10)
        assert not b[key].requires_grad


def test_train_steps_agree():
    model = petfunc.PET(CONFIG)
    params = _params(seed=2)
    batch = _batch()
    optimizer = petfunc.make_optimizer(1e-3)
    weights = petfunc.LossWeights.make(1.0, 1.0, 1.0)
    states = {}
    for autodiff in ("func", "autograd"):
        step = petfunc.make_train_step(model, optimizer, weights, autodiff=autodiff)
        state = petfunc.init_state(params, optimizer)
        for _ in range(3):
            state, _ = step(state, batch)
        states[autodiff] = petfunc.tree.flatten(state.params)
    for key, value in states["func"].items():
        _close(states["autograd"][key], value, 1e-9)


def test_autograd_refuses_transforms_and_tracing():
    model = petfunc.PET(CONFIG)
    params = _params()
    positions, cell, neighbors = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
    fn = energy_and_forces(model.energy, "autograd")
    with pytest.raises(RuntimeError, match="autodiff='func'"):
        torch.func.grad(lambda x: fn(params, x, cell, neighbors)[1].sum())(positions)
    step = petfunc.make_grad_step(model, petfunc.LossWeights.make(1.0, 1.0, 0.0), autodiff="autograd")
    with pytest.raises(RuntimeError, match="autodiff='func'"):
        petfunc.compile(step, params, _batch(), backend="aot_eager")
    with pytest.raises(ValueError, match="autodiff"):
        energy_and_forces(model.energy, "jax")


@pytest.mark.parametrize("autodiff", ["func", "autograd"])
def test_inputs_on_other_devices_or_dtypes_are_named(autodiff):
    """Positions and cell meet in the strain before the energy function checks them:
    a mismatch is named there, not left to bmm's backward."""
    model = petfunc.PET(CONFIG)
    params = _params()
    positions, cell, neighbors = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)
    for make in (energy_forces_stress, energy_and_forces, energy_forces_strain_derivative):
        fn = make(model.energy, autodiff)
        with pytest.raises(
            TypeError, match=r"positions are torch.float64 on meta, but the cell is torch.float64 on cpu"
        ):
            fn(params, positions.to("meta"), cell, neighbors)
        with pytest.raises(
            TypeError, match=r"positions are torch.float32 on cpu, but the cell is torch.float64 on cpu"
        ):
            fn(params, positions.float(), cell, neighbors)
        with pytest.raises(
            TypeError, match=r"the cell is torch.float64 on meta; the parameters are torch.float64 on cpu"
        ):
            fn(params, positions, cell.to("meta"), neighbors)
        with pytest.raises(TypeError, match=r"cell must be a torch.Tensor, got ndarray"):
            fn(params, positions, cell.numpy(), neighbors)


def test_the_input_check_traces_and_vmaps():
    """The dtype and device check reads static properties only: it runs under make_fx
    with symbolic sizes and under vmap without a guard or an error."""
    positions, cell, neighbors = petfunc.from_atoms(_frames(), CONFIG, dtype=F64)

    def toy_energy(params, x, c, nb):
        per_atom = params["k"] * (x**2).sum(1) + (c**2).sum((1, 2))[nb.structure_index]
        return torch.zeros(c.shape[0], dtype=x.dtype).index_add(0, nb.structure_index, per_atom)

    fn = energy_forces_stress(toy_energy)
    params = {"k": torch.tensor(0.5, dtype=F64)}
    expected = fn(params, positions, cell, neighbors)
    traced = make_fx(fn, tracing_mode="symbolic")(params, positions, cell, neighbors)
    for x, y in zip(expected, traced(params, positions, cell, neighbors)):
        torch.testing.assert_close(y, x, equal_nan=True)
    stacked = torch.func.vmap(lambda k: fn({"k": k}, positions, cell, neighbors)[0])(
        torch.tensor([0.5, 1.0], dtype=F64)
    )
    torch.testing.assert_close(stacked[0], expected[0])
