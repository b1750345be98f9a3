"""ZBL repulsion (``PETConfig(zbl=True)``): parity with metatrain, derivatives, tracing."""

from __future__ import annotations

import ase
import numpy as np
import pytest
import torch
from ase.build import bulk, molecule
from torch.func import grad, jacrev

import petfunc
from petfunc import structures
from petfunc.derivatives import energy_forces_strain_derivative
from petfunc.graph.neighbors import Neighbors
from petfunc.model import edge_vectors, energy, per_atom_energies, zbl


SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)
LIGHT = (1, 6, 8)
HEAVY = (1, 55, 79)  # Cs: ZBL list 2 x 2.44 = 4.88 Å > the PET cutoff 4.5 Å
COPPER_GOLD = (1, 29, 79)  # ZBL list 2 x 1.36 = 2.72 Å, longer than a 2.4 Å PET cutoff


def _light_frames():
    h2 = ase.Atoms("H2", positions=[[0.0, 0.0, 0.0], [0.5, 0.1, 0.05]])  # H2 at ~0.51 Å
    water = molecule("H2O")
    water.positions *= 0.6  # compressed
    water.positions += [3.0, 0.0, 0.0]
    carbon = bulk("C", "diamond", a=3.0).repeat((2, 1, 1))  # compressed diamond
    carbon.positions += np.random.default_rng(0).normal(0.0, 0.15, carbon.positions.shape)
    carbon[1].symbol = "O"
    carbon[2].symbol = "H"
    return [h2 + water, carbon]


def _heavy_frames(heavy, a=3.2):
    cell = bulk("Au", "fcc", a=a) * (1, 1, 2)
    cell[0].number = heavy
    cell[1].symbol = "H"
    cell.positions += np.random.default_rng(1).normal(0.0, 0.1, cell.positions.shape)
    cluster = ase.Atoms(numbers=[heavy, 79, 1], positions=[[0.0, 0.0, 0.0], [2.0, 0.1, 0.0], [1.0, 1.0, 0.3]])
    return [cluster, cell]


def _config(types, **kw):
    return petfunc.PETConfig(atomic_types=types, zbl=True, **{**SMALL, **kw})


def _zbl_only_graph(frames, config):
    pos, cell, nb = petfunc.from_atoms(frames, config, dtype=torch.float64)
    return pos, cell, nb


def _mtt_zbl(types):
    from metatrain.utils.additive import ZBL
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    targets = {"energy": get_energy_target_info("energy", {"quantity": "energy", "unit": "eV"})}
    info = DatasetInfo(length_unit="angstrom", atomic_types=list(types), targets=targets)
    return ZBL({}, info).to(torch.float64)


# ---------------------------------------------------------------------------------------
# cutoffs and the pair potential


def test_zbl_cutoff_values():
    assert zbl.zbl_cutoff(_config(LIGHT)) == pytest.approx(2 * 0.76)
    assert zbl.zbl_cutoff(_config(COPPER_GOLD)) == pytest.approx(2 * 1.36)
    assert zbl.zbl_cutoff(_config(HEAVY)) == pytest.approx(2 * 2.44)
    assert structures.list_cutoff(_config(LIGHT)) == 4.5
    assert structures.list_cutoff(_config(HEAVY)) == pytest.approx(4.88)
    assert structures.list_cutoff(_config(COPPER_GOLD, cutoff=2.4)) == pytest.approx(2.72)
    config = petfunc.PETConfig(atomic_types=HEAVY, zbl=False)
    assert structures.list_cutoff(config) == 4.5


@pytest.mark.parametrize("types", [LIGHT, HEAVY, COPPER_GOLD, (1, 6, 118)])
def test_zbl_cutoff_matches_metatrain(types):
    pytest.importorskip("metatrain")
    assert zbl.zbl_cutoff(_config(types)) == _mtt_zbl(types).cutoff_radius


def test_pair_energies_match_metatrain():
    pytest.importorskip("metatrain")
    types = (1, 6, 8, 29, 55, 79)
    reference = _mtt_zbl(types)
    rng = np.random.default_rng(3)
    z_i = torch.tensor(rng.choice(types, 400), dtype=torch.int32)
    z_j = torch.tensor(rng.choice(types, 400), dtype=torch.int32)
    r = torch.tensor(rng.uniform(0.05, 5.0, 400), dtype=torch.float64)
    radii = dict(zip(types, zbl.covalent_radii(types)))
    r_c = torch.tensor([radii[int(a)] + radii[int(b)] for a, b in zip(z_i, z_j)], dtype=torch.float64)
    ours = 0.5 * zbl.pair_energies(z_i, z_j, r, r_c)
    theirs = reference.get_pairwise_zbl(z_i, z_j, r)
    assert (r > r_c).any() and (r <= r_c).any()
    assert torch.all(ours[r > r_c] == 0.0)
    torch.testing.assert_close(ours, theirs, rtol=1e-13, atol=1e-13)


def test_pair_energy_switch_is_smooth_at_cutoff():
    """E, dE/dr and d2E/dr2 vanish at r_c (from below); the energy is 0 beyond."""
    z_i = torch.tensor([1, 79], dtype=torch.int32)
    z_j = torch.tensor([8, 55], dtype=torch.int32)
    r_c = torch.tensor([0.31 + 0.66, 1.36 + 2.44], dtype=torch.float64)

    def e(r):
        return zbl.pair_energies(z_i, z_j, r, r_c).sum()

    r = r_c - 1e-9
    e_c = zbl.pair_energies(z_i, z_j, r, r_c)
    d1 = grad(e)(r)
    d2 = grad(lambda x: grad(e)(x).sum())(r)  # pairs are independent: the diagonal
    scale = zbl.pair_energies(z_i, z_j, 0.5 * r_c, r_c)
    assert torch.all(e_c.abs() < 1e-10 * scale)
    assert torch.all(d1.abs() < 1e-8 * scale)
    assert torch.all(d2.abs() < 1e-6 * scale)
    beyond = zbl.pair_energies(z_i, z_j, r_c + 1e-9, r_c)
    assert torch.all(beyond == 0.0)
    assert torch.all(grad(e)(r_c + 1e-9) == 0.0)


# ---------------------------------------------------------------------------------------
# parity of PET + ZBL with metatrain


CASES = {
    "light": (LIGHT, {}, _light_frames),
    "heavy_cs": (HEAVY, {}, lambda: _heavy_frames(55)),
    "cu_au_short_cutoff": (COPPER_GOLD, {"cutoff": 2.4}, lambda: _heavy_frames(29, a=3.5)),
    # the adaptive count must ignore the flat-list edges beyond the PET cutoff
    "heavy_cs_adaptive": (HEAVY, {"num_neighbors_adaptive": 6}, lambda: _heavy_frames(55)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_pet_with_zbl_matches_metatrain(case):
    pytest.importorskip("metatrain")
    from tests.helpers.mtt_reference import evaluate, load_params, make_model

    types, extra, make_frames = CASES[case]
    config = _config(types, **extra)
    frames = make_frames()
    params = petfunc.init(config, seed=1, dtype=torch.float64)
    params["composition_weights"] = torch.linspace(-3.0, 2.0, len(types), dtype=torch.float64)
    params["energy_scale"] = torch.tensor(0.7, dtype=torch.float64)

    reference = make_model(config)
    load_params(reference, params)
    ref_energy, ref_per_atom, ref_forces, ref_strain = evaluate(reference, frames)

    positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=torch.float64)
    fn = energy_forces_strain_derivative(lambda p, x, c, n: energy(p, x, c, n, config))
    e, f, w = fn(params, positions, cell, neighbors)
    per_atom = per_atom_energies(params, positions, cell, neighbors, config)

    # ZBL matters here: it acts in every structure (eV-sized somewhere) and makes a
    # sizeable share of the forces
    e_zbl = zbl.energy(positions, cell, neighbors, config)
    assert torch.all(e_zbl > 0.05) and e_zbl.max() > 1.0, e_zbl
    f_zbl = -grad(lambda x: zbl.energy(x, cell, neighbors, config).sum())(positions)
    assert f_zbl.abs().max() > 0.3 * f.abs().max()

    def rel(a, b):
        return float((a - b).abs().max() / b.abs().max())

    assert rel(e, ref_energy) < 1e-10
    assert rel(per_atom, ref_per_atom) < 1e-10
    assert rel(f, ref_forces) < 1e-10
    assert rel(w, ref_strain) < 1e-10
    torch.testing.assert_close(per_atom.sum(), e.sum(), rtol=1e-12, atol=1e-12)

    # the flat list reaches the ZBL range; PET's NEF grid holds only edges within its cutoff
    vectors = edge_vectors(positions, cell, neighbors)
    d = torch.linalg.vector_norm(vectors, dim=-1)
    nef_d = d[neighbors.kept_edges]
    assert nef_d.max() <= config.cutoff
    if not config.adaptive:
        assert len(neighbors.kept_edges) == int((d <= config.cutoff).sum())
    if structures.list_cutoff(config) > config.cutoff:
        assert (d > config.cutoff).any()
        assert d.max() <= structures.list_cutoff(config)


# ---------------------------------------------------------------------------------------
# the flat list, derivatives, tracing


def _filtered(neighbors: Neighbors, keep: torch.Tensor) -> Neighbors:
    keep = torch.nonzero(keep).reshape(-1)
    return neighbors._replace(
        centers=neighbors.centers[keep],
        neighbors=neighbors.neighbors[keep],
        cell_shifts=neighbors.cell_shifts[keep],
    )


def test_edges_beyond_pair_cutoff_contribute_exactly_zero():
    config = _config(HEAVY)
    positions, cell, neighbors = _zbl_only_graph(_heavy_frames(55), config)
    d = torch.linalg.vector_norm(edge_vectors(positions, cell, neighbors), dim=-1)
    radii = torch.tensor(zbl.covalent_radii(config.atomic_types), dtype=torch.float64)
    r_c = radii[neighbors.species[neighbors.centers]] + radii[neighbors.species[neighbors.neighbors]]
    inside = d <= r_c
    assert (~inside).sum() > 0 and inside.sum() > 0
    short = _filtered(neighbors, inside)

    long_e = zbl.atomic_energies(positions, cell, neighbors, config)
    short_e = zbl.atomic_energies(positions, cell, short, config)
    assert torch.equal(long_e, short_e)
    g_long = grad(lambda x: zbl.atomic_energies(x, cell, neighbors, config).sum())(positions)
    g_short = grad(lambda x: zbl.atomic_energies(x, cell, short, config).sum())(positions)
    torch.testing.assert_close(g_long, g_short, rtol=1e-14, atol=1e-14)


def test_zero_length_padding_edge_is_harmless():
    config = _config(LIGHT)
    positions, cell, neighbors = _zbl_only_graph(_light_frames(), config)
    padded = neighbors._replace(
        centers=torch.cat([neighbors.centers, torch.tensor([0])]),
        neighbors=torch.cat([neighbors.neighbors, torch.tensor([0])]),
        cell_shifts=torch.cat([neighbors.cell_shifts, torch.zeros(1, 3, dtype=torch.long)]),
    )
    assert torch.equal(
        zbl.atomic_energies(positions, cell, padded, config),
        zbl.atomic_energies(positions, cell, neighbors, config),
    )
    g = grad(lambda x: zbl.energy(x, cell, padded, config).sum())(positions)
    assert torch.isfinite(g).all()


def test_forces_and_strain_match_finite_differences():
    config = _config(LIGHT)
    positions, cell, neighbors = _zbl_only_graph(_light_frames(), config)
    fn = energy_forces_strain_derivative(lambda p, x, c, n: zbl.energy(x, c, n, config))
    _, forces, strain = fn(None, positions, cell, neighbors)

    h = 1e-5
    fd = torch.zeros_like(positions)
    for i in range(positions.shape[0]):
        for a in range(3):
            plus, minus = positions.clone(), positions.clone()
            plus[i, a] += h
            minus[i, a] -= h
            fd[i, a] = -(
                zbl.energy(plus, cell, neighbors, config).sum()
                - zbl.energy(minus, cell, neighbors, config).sum()
            ) / (2 * h)
    torch.testing.assert_close(forces, fd, rtol=1e-6, atol=1e-6 * float(forces.abs().max()))

    # strain of the periodic structure (index 1) by central differences
    s = 1
    sidx = neighbors.structure_index
    fd_strain = torch.zeros(3, 3, dtype=torch.float64)
    for a in range(3):
        for b in range(3):
            values = []
            for sign in (1.0, -1.0):
                eps = torch.eye(3, dtype=torch.float64)
                eps[a, b] += sign * h
                strained = torch.where((sidx == s)[:, None], positions @ eps, positions)
                c = cell.clone()
                c[s] = cell[s] @ eps
                values.append(zbl.energy(strained, c, neighbors, config)[s])
            fd_strain[a, b] = (values[0] - values[1]) / (2 * h)
    torch.testing.assert_close(strain[s], fd_strain, rtol=1e-6, atol=1e-6 * float(strain[s].abs().max()))


def test_full_model_forces_match_finite_differences():
    config = _config(LIGHT)
    frames = _light_frames()[:1]
    positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=torch.float64)
    params = petfunc.init(config, seed=2, dtype=torch.float64)
    forces = -grad(lambda x: energy(params, x, cell, neighbors, config).sum())(positions)
    h = 1e-5
    fd = torch.zeros_like(positions)
    for i in range(positions.shape[0]):
        for a in range(3):
            plus, minus = positions.clone(), positions.clone()
            plus[i, a] += h
            minus[i, a] -= h
            fd[i, a] = -(
                energy(params, plus, cell, neighbors, config).sum()
                - energy(params, minus, cell, neighbors, config).sum()
            ) / (2 * h)
    torch.testing.assert_close(forces, fd, rtol=1e-6, atol=1e-6 * float(forces.abs().max()))


def test_second_derivative():
    """The Hessian (force training differentiates forces again) matches differences of
    forces and is symmetric."""
    config = _config(LIGHT)
    positions, cell, neighbors = _zbl_only_graph(_light_frames()[:1], config)

    def gradient(x):
        return grad(lambda y: zbl.energy(y, cell, neighbors, config).sum())(x)

    hessian = jacrev(gradient)(positions).reshape(positions.numel(), positions.numel())
    torch.testing.assert_close(hessian, hessian.T, rtol=1e-10, atol=1e-10 * float(hessian.abs().max()))
    h = 1e-6
    columns = []
    for k in range(positions.numel()):
        step = torch.zeros(positions.numel(), dtype=torch.float64)
        step[k] = h
        step = step.reshape(positions.shape)
        columns.append(((gradient(positions + step) - gradient(positions - step)) / (2 * h)).reshape(-1))
    fd = torch.stack(columns, dim=1)
    torch.testing.assert_close(hessian, fd, rtol=1e-5, atol=1e-5 * float(hessian.abs().max()))


def test_force_loss_gradient_through_zbl_model():
    """grad over params of a force loss runs (double backward through ZBL) and is finite."""
    config = _config(LIGHT)
    positions, cell, neighbors = petfunc.from_atoms(_light_frames(), config, dtype=torch.float64)
    params = petfunc.init(config, seed=0, dtype=torch.float64)

    def loss(p):
        f = -grad(lambda x: energy(p, x, cell, neighbors, config).sum())(positions)
        return (f**2).mean()

    g = grad(loss)(params)
    flat = petfunc.tree.flatten(g)
    assert all(torch.isfinite(v).all() for v in flat.values())
    assert any(float(v.abs().max()) > 0 for v in flat.values())


def test_float32_positions():
    config = _config(LIGHT)
    positions, cell, neighbors = _zbl_only_graph(_light_frames(), config)
    e64 = zbl.atomic_energies(positions, cell, neighbors, config)
    e32 = zbl.atomic_energies(positions.float(), cell.float(), neighbors, config)
    assert e32.dtype == torch.float32
    torch.testing.assert_close(e32.double(), e64, rtol=1e-5, atol=1e-5 * float(e64.abs().max()))


def test_traces_with_dynamic_shapes():
    from torch.fx.experimental.proxy_tensor import make_fx

    config = _config(LIGHT)

    def forces(positions, cell, neighbors):
        return -grad(lambda x: zbl.energy(x, cell, neighbors, config).sum())(positions)

    # sizes 0 and 1 are specialised by symbolic tracing: trace with 2 structures
    mol, carbon = _light_frames()
    first = _zbl_only_graph([mol, carbon], config)
    traced = make_fx(forces, tracing_mode="symbolic")(*first)
    assert "item" not in traced.code and "nonzero" not in traced.code
    others = ([carbon, mol, carbon], [mol, mol], [carbon.repeat((1, 2, 1)), mol])
    for inputs in (first, *(_zbl_only_graph(f, config) for f in others)):
        torch.testing.assert_close(traced(*inputs), forces(*inputs), rtol=1e-12, atol=1e-12)
