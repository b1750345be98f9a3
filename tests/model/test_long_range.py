"""Long-range (Coulomb) features in the energy: parity with metatrain's torch-pme
featurizer in its evaluation mode (P3M, direct sums) and training mode (Ewald), finite
differences of forces and stress, Hessians and committees, float32, Ewald against
P3M, inductor, and the backend choice on a GPU."""

import warnings

import ase
import ase.build
import numpy as np
import pytest
import torch

import petfunc
from petfunc.graph import long_range as graph_long_range
from petfunc.model import long_range
from tests.helpers.long_range import diamond, lr_config, molecule, perturbed_params, relative, triclinic
from tests.helpers.patches import needs_patches


# ---------------------------------------------------------------------------------------
# parity with metatrain


CONFIGS = {
    "feedforward-p3m5": {},
    "residual-p3m4": dict(
        featurizer_type="residual", smearing=1.1, kspace_resolution=0.9, interpolation_nodes=4, cutoff=4.0
    ),
    "cosine-p3m3": dict(cutoff_function="Cosine", smearing=1.7, kspace_resolution=1.6, interpolation_nodes=3),
    # a small smearing: the Nyquist bins of the triclinic cell's mesh count
    "narrow-p3m4": dict(smearing=0.5, interpolation_nodes=4),
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_evaluation_matches_metatrain(name):
    """P3M for cells and direct sums for molecules (metatrain's evaluation mode), alone
    and in one mixed batch: energies, per-atom energies, forces, dE/dstrain."""
    ref = pytest.importorskip("tests.helpers.mtt_reference")
    pytest.importorskip("torchpme")  # metatrain's long-range featurizer needs it
    config = lr_config(**CONFIGS[name])
    params = perturbed_params(config)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    model = petfunc.PET(config)
    efs = petfunc.energy_forces_strain_derivative(model.energy)
    for frames in ([molecule()], [diamond()], [triclinic()], [molecule(), diamond(), triclinic()]):
        energy, per_atom, forces, strain = ref.evaluate(mtt, frames)
        positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=torch.float64)
        e, f, w = efs(params, positions, cell, neighbors)
        pa = model.per_atom_energies(params, positions, cell, neighbors)
        assert relative(e, energy) < 1e-12
        assert relative(pa, per_atom) < 1e-12
        assert relative(f, forces) < 1e-11
        assert relative(w, strain) < 1e-11


def test_long_range_part_is_not_negligible():
    """The comparison above would not notice a missing long-range part if it were
    tiny: zeroing its output layer changes energies and forces at the percent level."""
    config = lr_config()
    params = perturbed_params(config)
    positions, cell, neighbors = petfunc.from_atoms([diamond()], config, dtype=torch.float64)
    efs = petfunc.energy_forces_strain_derivative(petfunc.PET(config).energy)
    e, f, _ = efs(params, positions, cell, neighbors)
    last = params["long_range_featurizer"]["out_projection"]["2"]
    off = {k: torch.zeros_like(v) for k, v in last.items()}
    params_off = dict(
        params,
        long_range_featurizer=dict(
            params["long_range_featurizer"],
            out_projection={"0": params["long_range_featurizer"]["out_projection"]["0"], "2": off},
        ),
    )
    e0, f0, _ = efs(params_off, positions, cell, neighbors)
    assert relative(e - e0, e) > 1e-3
    assert relative(f - f0, f) > 1e-2


def test_training_mode_matches_metatrain():
    """Ewald (metatrain's training mode): raw energies, forces and the parameter
    gradient of an energy + force loss, against metatrain's training-mode autograd."""
    ref = pytest.importorskip("tests.helpers.mtt_reference")
    pytest.importorskip("torchpme")  # metatrain's long-range featurizer needs it
    from metatomic.torch import ModelOutput, System, systems_to_torch
    from metatrain.utils.neighbor_lists import get_requested_neighbor_lists, get_system_with_neighbor_lists

    config = lr_config(smearing=1.2, kspace_resolution=1.0)
    params = perturbed_params(config)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    mtt.train()
    frames = [diamond(), molecule(), triclinic()]
    requested = get_requested_neighbor_lists(mtt)
    systems, positions_list = [], []
    for system in systems_to_torch(frames, dtype=torch.float64):
        x = system.positions.clone().requires_grad_(True)
        positions_list.append(x)
        systems.append(
            get_system_with_neighbor_lists(
                System(types=system.types, positions=x, cell=system.cell, pbc=system.pbc), requested
            )
        )
    out = mtt(systems, {"energy": ModelOutput(quantity="energy", unit="eV", sample_kind="system")})
    energy = out["energy"].block().values[:, 0]
    forces = -torch.cat(torch.autograd.grad(energy.sum(), positions_list, create_graph=True))
    loss = (energy**2).sum() + (forces**2).sum()
    names = [n for n, p in mtt.named_parameters() if p.requires_grad]
    grads = torch.autograd.grad(
        loss, [p for n, p in mtt.named_parameters() if p.requires_grad], allow_unused=True
    )
    expected = {n: g for n, g in zip(names, grads) if g is not None}

    model = petfunc.PET(config)
    positions, cell, neighbors = petfunc.from_atoms(frames, config, dtype=torch.float64, long_range="ewald")

    def ours(p):
        e, f = petfunc.energy_and_forces(model.raw_energy)(p, positions, cell, neighbors)
        return (e**2).sum() + (f**2).sum(), (e, f)

    got, (e, f) = torch.func.grad(ours, has_aux=True)(params)
    assert relative(e, energy.detach()) < 1e-12
    assert relative(f, forces.detach()) < 1e-11
    flat = petfunc.io.to_metatrain_state_dict(got)
    compared = 0
    for name, value in expected.items():
        if name.startswith("system_conditioning."):
            continue
        assert relative(flat[name], value) < 1e-8, name
        compared += 1
    assert compared == len([k for k in flat if not k.startswith("backend.species")])
    assert any(k.startswith("long_range_featurizer.") for k in expected)


# ---------------------------------------------------------------------------------------
# derivatives


@pytest.mark.parametrize("method", graph_long_range.METHODS)
def test_forces_and_stress_are_finite_differences(method):
    """Forces and dE/dstrain of a cell (Ewald or P3M) and forces of a molecule (direct)
    against central differences, float64."""
    config = lr_config(smearing=1.3, kspace_resolution=1.1)
    params = perturbed_params(config)
    model = petfunc.PET(config)
    efs = petfunc.energy_forces_strain_derivative(model.energy)
    for atoms in (triclinic(), molecule()):
        positions, cell, neighbors = petfunc.from_atoms(
            [atoms], config, dtype=torch.float64, long_range=method
        )
        _, forces, strain = efs(params, positions, cell, neighbors)
        h = 1e-5
        for atom, axis in ((0, 0), (1, 2), (2, 1)):
            plus, minus = positions.clone(), positions.clone()
            plus[atom, axis] += h
            minus[atom, axis] -= h
            fd = -(
                model.energy(params, plus, cell, neighbors) - model.energy(params, minus, cell, neighbors)
            ) / (2 * h)
            assert abs(float(fd[0] - forces[atom, axis])) < 1e-6 * max(1.0, float(forces.abs().max()))
        if atoms.pbc.any():
            for a, b in ((0, 0), (0, 1), (2, 1)):
                eps = torch.zeros(3, 3, dtype=torch.float64)
                eps[a, b] = h
                up = model.energy(
                    params,
                    positions @ (torch.eye(3, dtype=torch.float64) + eps),
                    cell @ (torch.eye(3, dtype=torch.float64) + eps),
                    neighbors,
                )
                down = model.energy(
                    params,
                    positions @ (torch.eye(3, dtype=torch.float64) - eps),
                    cell @ (torch.eye(3, dtype=torch.float64) - eps),
                    neighbors,
                )
                fd = (up - down) / (2 * h)
                assert abs(float(fd[0] - strain[0, a, b])) < 1e-6 * max(1.0, float(strain.abs().max()))


@needs_patches("layer_norm_decomposition")
@pytest.mark.parametrize("method", graph_long_range.METHODS)
def test_hessian_and_committee(method):
    """Second derivatives and vmap go through the FFTs and Ewald sums: the Hessian of
    a cell is symmetric and equals finite differences of the forces; a vmap'd
    committee equals its members one by one."""
    config = lr_config(smearing=1.3, kspace_resolution=1.1)
    params = perturbed_params(config)
    model = petfunc.PET(config)
    positions, cell, neighbors = petfunc.from_atoms(
        [triclinic()], config, dtype=torch.float64, long_range=method
    )
    hessian = petfunc.hessian(model.energy)(params, positions, cell, neighbors).reshape(9, 9)
    assert float((hessian - hessian.T).abs().max()) < 1e-10 * float(hessian.abs().max())
    forces = petfunc.forces(model.energy)
    h = 1e-5
    for k in (0, 4, 8):
        step = torch.zeros(9, dtype=torch.float64)
        step[k] = h
        up = forces(params, positions + step.reshape(3, 3), cell, neighbors)
        down = forces(params, positions - step.reshape(3, 3), cell, neighbors)
        column = -(up - down).reshape(-1) / (2 * h)
        assert relative(hessian[:, k], column) < 1e-6

    members = [perturbed_params(config, seed=s) for s in (1, 2, 3)]
    stacked = petfunc.tree.stack(members)
    both = petfunc.from_atoms([triclinic(), molecule()], config, dtype=torch.float64, long_range=method)
    committee = torch.func.vmap(model.energy, in_dims=(0, None, None, None))(stacked, *both)
    one_by_one = torch.stack([model.energy(p, *both) for p in members])
    assert relative(committee, one_by_one) < 1e-12


def test_float32_p3m_stress_is_finite_on_a_skewed_cell():
    """On this triclinic cell a float32 P3M stress is NaN in metatrain and torch-pme:
    near the zeros of the assignment transform u2 is tiny and the derivative of 1/u2
    overflows float32. petfunc computes the filter in float64: the stress is finite."""
    cell = [
        [0.1275630698106605, 3.8943382352980405, 4.028415802274155],
        [4.54732734295724, -0.15872097399302576, 4.0794188467815236],
        [4.358008085459175, 4.0474560753479984, 0.23382439329760002],
    ]
    atoms = ase.Atoms("Pd8", scaled_positions=np.random.default_rng(0).random((8, 3)), cell=cell, pbc=True)
    config = petfunc.PETConfig(
        atomic_types=(46,),
        cutoff=4.0,
        cutoff_width=0.4,
        d_pet=16,
        d_head=16,
        d_node=48,
        d_feedforward=24,
        num_heads=4,
        num_attention_layers=1,
        featurizer_type="residual",
        long_range=dict(enable=True, smearing=1.1, kspace_resolution=0.9, interpolation_nodes=3),
    )
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=torch.float64)
    results = {}
    for dtype in (torch.float32, torch.float64):
        cast = petfunc.tree.tree_map(lambda t, dtype=dtype: t.to(dtype), params)
        positions, cell_t, neighbors = petfunc.from_atoms([atoms], config, dtype=dtype)
        results[dtype] = petfunc.energy_forces_stress(model.energy)(cast, positions, cell_t, neighbors)
    for single, double in zip(results[torch.float32], results[torch.float64]):
        assert torch.isfinite(single).all()
        assert (single.double() - double).abs().max() <= 1e-4 * double.abs().max()


def test_ewald_converges_to_p3m():
    """Two methods, one potential: Ewald and P3M agree to the P3M discretisation error,
    and P3M comes closer on a finer mesh."""
    config = lr_config()
    fine = lr_config(kspace_resolution=0.5)
    q = torch.randn(8, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    q = q - q.mean(dim=0)
    atoms = diamond()

    def potentials(config, method):
        positions, cell, neighbors = petfunc.from_atoms(
            [atoms], config, dtype=torch.float64, long_range=method
        )
        vectors = petfunc.model.edge_vectors(positions, cell, neighbors)
        distances = torch.sqrt((vectors**2).sum(dim=1) + 1e-15)
        return long_range.potentials(
            config, q, positions, cell, neighbors, neighbors.centers, neighbors.neighbors, distances
        )

    ewald = potentials(fine, "ewald")
    coarse_error = relative(potentials(config, "p3m"), ewald)
    fine_error = relative(potentials(fine, "p3m"), ewald)
    assert fine_error < coarse_error < 1e-2
    assert fine_error < 1e-4


# ---------------------------------------------------------------------------------------
# compiled


@pytest.mark.slow
@pytest.mark.parametrize("cached", [False, True], ids=["traced", "reloaded"])
@pytest.mark.parametrize("batch", ["crystal", "crystal+molecule", "molecule+crystals"])
def test_inductor_p3m_equals_eager(batch, cached):
    """petfunc.compile with inductor gives the eager energies, forces and strain
    derivatives of P3M batches, a lone crystal included (a graph for one structure),
    for the graph as traced and as reloaded from the trace cache (inductor fuses
    the two differently). These batches show both of inductor's known P3M faults:
    torch 2.11 fuses the backward of the cell volume's row selects wrongly (a strain
    derivative ~100 % off), and torch 2.13 sums the parts of the cell gradient before
    one of them is accumulated (~100 % off too, for a lone crystal, and for the
    calculator's crystal + padding batch as reloaded); ``long_range.potentials``
    computes both so that inductor gets them right."""
    config = lr_config()
    params = perturbed_params(config)
    crystal = diamond()
    crystal.rattle(0.08, seed=10)
    frames = {
        "crystal": [crystal],
        "crystal+molecule": [crystal, molecule()],
        "molecule+crystals": [molecule(), triclinic(), crystal],
    }[batch]
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(config).energy_terms)
    inputs = petfunc.from_atoms(frames, config, dtype=torch.float64)
    with warnings.catch_warnings():
        # a graph the trace cache cannot load again would only be traced again, with
        # a warning: the cache must load these graphs
        warnings.filterwarnings("error", message="petfunc.compile: ignoring the unreadable")
        compiled = petfunc.compile(
            fn,
            params,
            *inputs,
            backend="inductor",
            static_argnums=(0,),
            cache_key=f"test_inductor_p3m_equals_eager {batch}" if cached else None,
        )
    for name, got, expected in zip(
        ("energy", "per-atom", "forces", "strain"), compiled(params, *inputs), fn(params, *inputs)
    ):
        assert relative(got, expected) < 1e-10, name


def test_old_inductor_is_not_used_for_p3m_on_a_gpu(monkeypatch):
    """torch 2.11's inductor miscompiles the P3M strain derivative (README) unless
    the energy avoids the fusion it gets wrong, as petfunc's does; that is checked
    on the CPU only: there inductor is allowed on every torch; for other devices on
    torch < 2.13 petfunc.compile refuses it for P3M inputs (not for Ewald ones) and
    the compiled calculator falls back to aot_eager with a warning. AOTInductor's P3M
    build is wrong on torch 2.11: export leaves it out there. (A meta tensor stands
    in for a GPU's: the refusal comes first.)"""

    import petfunc.ase
    from petfunc.export import package as export

    monkeypatch.setattr(long_range, "P3M_INDUCTOR_GPU_CORRECT", False)
    assert long_range.p3m_inductor_correct("cpu") and not long_range.p3m_inductor_correct("cuda")
    config = lr_config()
    params = perturbed_params(config)
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(config).energy_terms)
    positions, cell, neighbors = petfunc.from_atoms([triclinic()], config, dtype=torch.float64)
    with pytest.raises(ValueError, match="not known to compile .* right on a GPU"):
        petfunc.compile(fn, params, positions.to("meta"), cell, neighbors, static_argnums=(0,))
    molecules = petfunc.from_atoms([molecule(), molecule()], config, dtype=torch.float64)
    assert not long_range.has_p3m_inputs((params, *molecules))
    assert long_range.has_p3m_inputs((params, positions, cell, neighbors))
    with pytest.warns(UserWarning, match="aot_eager"):
        assert long_range.calculator_backend(config, "inductor", "cuda") == "aot_eager"
    assert long_range.calculator_backend(config, "aot_eager", "cuda") == "aot_eager"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert long_range.calculator_backend(config, "inductor", "cpu") == "inductor"
        assert petfunc.ase.PETCalculator(config, params, compile=True).backend == "inductor"
    monkeypatch.setattr(export, "P3M_AOTI_CORRECT", False)  # where export looks it up
    assert not export.default_aoti("cpu", config) and export.default_aoti("cpu", config, "ewald")
    with pytest.raises(ValueError, match="miscompiles"):
        export.export(config, params, "unused.pt2", aoti=True)
