"""petfunc against metatrain's own eager PET on the same weights (float64).

Energies, per-atom energies, forces and strain derivatives (stress) must agree to
1e-10 relative for the default architecture and for every architecture switch, and
``from_metatrain`` must reproduce every checkpoint shipped with metatrain's PET tests.

Energies are compared without the composition term (it is large and identical on
both sides by construction): ``E - sum_i w_{Z_i}`` and ``e_i - w_{Z_i}``.
"""

import glob
import gzip
import os

import numpy as np
import pytest
import torch


pytest.importorskip("metatrain")

import ase
import ase.build
from metatrain.utils.io import model_from_checkpoint

import petfunc

from helpers import mtt_reference as ref


RTOL = 1e-10
CHECKPOINT_DIR = os.path.join(
    os.path.dirname(__import__("metatrain.pet", fromlist=["_"]).__file__), "tests", "checkpoints"
)
CHECKPOINTS = sorted(glob.glob(os.path.join(CHECKPOINT_DIR, "*.ckpt.gz")))

SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


# ---------------------------------------------------------------------------------------
# structures


def _molecules():
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    acetamide = ase.build.molecule("CH3CONH2")  # has N: every species of (1, 6, 7, 8)
    acetamide.rattle(0.05, seed=2)
    return [ethanol, acetamide]


def _small_cell():
    """2-atom primitive diamond: lattice vectors of 2.5 A, far below the 4.5 A cutoff."""
    atoms = ase.build.bulk("C", "diamond", a=3.57)
    atoms.rattle(0.05, seed=3)
    return atoms


def _cubic_cell():
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.symbols[[1, 6]] = "N"
    atoms.rattle(0.08, seed=4)
    return atoms


def _slab():
    """Mixed pbc (T, T, F): a two-layer C/O/H slab, zero cell row along z."""
    positions = [
        [0.0, 0.0, 0.0],
        [1.3, 1.2, 0.1],
        [0.1, 1.4, 1.3],
        [1.5, 0.2, 1.4],
        [0.8, 0.7, 2.5],
    ]
    atoms = ase.Atoms(
        "CCOCH",
        positions=positions,
        cell=[[2.6, 0.0, 0.0], [0.4, 2.7, 0.0], [0, 0, 0]],
        pbc=[True, True, False],
    )
    atoms.rattle(0.03, seed=5)
    return atoms


def frames():
    return _molecules() + [_small_cell(), _cubic_cell(), _slab()]


# ---------------------------------------------------------------------------------------
# helpers


def random_params(config, seed=0):
    """Fresh float64 parameters with perturbed norms, random composition and a scale."""
    params = petfunc.PET(config).init(seed=seed, dtype=torch.float64)
    generator = torch.Generator().manual_seed(seed + 1000)
    flat = petfunc.tree.flatten(params)
    for key, value in flat.items():
        if "norm" in key:  # weights 1 and biases 0 would hide a missing norm affine
            noise = torch.randn(value.shape, generator=generator, dtype=torch.float64)
            flat[key] = value + 0.2 * noise
    for key, value in flat.items():
        if key.startswith("system_conditioning.project.2."):  # the gate starts at zero
            flat[key] = torch.randn(value.shape, generator=generator, dtype=torch.float64) / 4
    n = config.num_species
    flat["composition_weights"] = 20.0 * torch.randn(n, generator=generator, dtype=torch.float64) - 50.0
    flat["energy_scale"] = torch.tensor(0.37, dtype=torch.float64)
    return petfunc.tree.unflatten(flat)


def assert_close(actual, expected, what, rtol=RTOL):
    """max |a - b| <= rtol * max |b| (with a tiny absolute floor for all-zero refs)."""
    actual, expected = actual.detach(), expected.detach()
    assert actual.shape == expected.shape, (what, actual.shape, expected.shape)
    scale = float(expected.abs().max()) if expected.numel() else 0.0
    error = float((actual - expected).abs().max()) if expected.numel() else 0.0
    assert error <= rtol * scale + 1e-13, f"{what}: max error {error:.3e}, scale {scale:.3e}"
    return error / max(scale, 1e-300)


def composition(params, frames_, config):
    w = petfunc.tree.flatten(params)["composition_weights"].double()
    lookup = {z: i for i, z in enumerate(config.atomic_types)}
    per_atom = [w[[lookup[int(z)] for z in a.numbers]] for a in frames_]
    return torch.cat(per_atom), torch.stack([p.sum() for p in per_atom])


def compare_energies_forces_strain(config, params, mtt_model, frames_, what=""):
    """Energy and per-atom energies (without composition), forces and strain
    derivatives of both implementations on ``frames_`` (one batch), compared.
    Returns ``(errors, petfunc forces, metatrain strain derivatives, inputs)``."""
    energy, per_atom, forces, strain = ref.evaluate(mtt_model, frames_)

    model = petfunc.PET(config)
    inputs = petfunc.from_atoms(frames_, config, dtype=torch.float64)
    e, f, w = petfunc.energy_forces_strain_derivative(model.energy)(params, *inputs)
    pa = model.per_atom_energies(params, *inputs)

    comp_atoms, comp_total = composition(params, frames_, config)
    errors = {
        "energy": assert_close(e - comp_total, energy - comp_total, f"{what}energy - composition"),
        "per_atom": assert_close(pa - comp_atoms, per_atom - comp_atoms, "per-atom energy - composition"),
        "forces": assert_close(f, forces, "forces"),
        "strain": assert_close(w, strain, "dE/dstrain"),
    }
    return errors, f, strain, inputs


def compare(config, params, mtt_model, frames_):
    """:func:`compare_energies_forces_strain`, plus the stress and non-zero forces."""
    errors, f, strain, inputs = compare_energies_forces_strain(config, params, mtt_model, frames_)
    _, _, stress = petfunc.energy_forces_stress(petfunc.PET(config).energy)(params, *inputs)
    # stress = dE/deps / V for the fully periodic structures, NaN for the others
    for s, atoms in enumerate(frames_):
        if atoms.pbc.all():
            assert_close(stress[s], strain[s] / abs(np.linalg.det(atoms.cell)), f"stress {s}")
        else:
            assert torch.isnan(stress[s]).all()
    assert torch.isfinite(f).all() and (f.abs() > 0).any()
    return errors


# ---------------------------------------------------------------------------------------
# random weights, every switch


def test_default_config():
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8))
    params = random_params(config)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare(config, params, mtt, frames())


VARIANTS = {
    "residual_featurizer": dict(featurizer_type="residual"),
    "PostLN": dict(transformer_type="PostLN"),
    "LayerNorm": dict(normalization="LayerNorm"),
    "SiLU": dict(activation="SiLU"),
    "Cosine": dict(cutoff_function="Cosine"),
    "d_node_equals_d_pet": dict(d_node=16),
    "attention_temperature": dict(attention_temperature=0.6),
    "adaptive_solver": dict(num_neighbors_adaptive=8, adaptive_cutoff_method="solver"),
    "adaptive_grid": dict(num_neighbors_adaptive=8, adaptive_cutoff_method="grid"),
    "three_gnn_one_attention": dict(num_gnn_layers=3, num_attention_layers=1),
    # settings metatrain builds that petfunc refused
    "no_attention_layer": dict(num_attention_layers=0),
    "no_attention_layer_residual": dict(num_attention_layers=0, featurizer_type="residual"),
    "no_gnn_layer": dict(num_gnn_layers=0, featurizer_type="feedforward"),
    "cutoff_width_beyond_cutoff": dict(cutoff=3.0, cutoff_width=3.5),
    "adaptive_zero_neighbours": dict(num_neighbors_adaptive=0, adaptive_cutoff_method="solver"),
    # the original PET (checkpoints <= v7): every legacy switch at once
    "original_pet": dict(
        featurizer_type="residual",
        transformer_type="PostLN",
        normalization="LayerNorm",
        activation="SiLU",
        cutoff_function="Cosine",
        d_node=16,
        cutoff_width=0.2,
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_switch(name):
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **{**SMALL, **VARIANTS[name]})
    params = random_params(config, seed=len(name))
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare(config, params, mtt, frames())


# ---------------------------------------------------------------------------------------
# charge and spin conditioning


def _charged(frames_, charges, spins):
    for atoms, q, m in zip(frames_, charges, spins):
        atoms.info.update(charge=q, spin_multiplicity=m)
    return frames_


@pytest.mark.parametrize("variant", ["feedforward", "residual", "d_node_equals_d_pet"])
def test_system_conditioning(variant):
    """Charge/spin embeddings (a random, non-zero gate) for both featurizers: the
    same numbers as metatrain for a batch of structures with different charges and
    spin multiplicities, which do change the energy."""
    switches = {
        "feedforward": {},
        "residual": dict(featurizer_type="residual"),
        "d_node_equals_d_pet": dict(d_node=16),
    }[variant]
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 7, 8),
        system_conditioning=True,
        max_charge=3,
        max_spin_multiplicity=4,
        **{**SMALL, **switches},
    )
    params = random_params(config, seed=11)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    charged = _charged(frames(), [0, -3, 1, 3, -1], [1, 2, 4, 3, 2])
    compare(config, params, mtt, charged)

    model = petfunc.PET(config)
    neutral = model.energy(params, *petfunc.from_atoms(frames(), config, dtype=torch.float64))
    energy = model.energy(params, *petfunc.from_atoms(charged, config, dtype=torch.float64))
    assert neutral[0] == energy[0]  # charge 0, multiplicity 1: the defaults
    assert (neutral[1:] - energy[1:]).abs().min() > 1e-3


def test_system_conditioning_input_errors():
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 7, 8), system_conditioning=True, max_charge=2, max_spin_multiplicity=3, **SMALL
    )
    cases = [
        ({"charge": 3}, r"structure 0: charge 3 is outside the model's range \[-2, 2\] \(max_charge\)"),
        ({"charge": 0.5}, "structure 0: charge must be an integer, got 0.5"),
        ({"spin_multiplicity": 0}, r"spin multiplicity 0 is outside the model's range \[1, 3\]"),
        ({"spin": 4}, r"spin multiplicity 4 is outside the model's range \[1, 3\]"),
        ({"charge": "one"}, "charge must be one integer, got 'one'"),
    ]
    for info, message in cases:
        atoms = _molecules()[0]
        atoms.info.update(info)
        with pytest.raises(ValueError, match=message):
            petfunc.from_atoms([atoms], config)
    # a float that is an integer is fine, as in metatrain; an unconditioned model ignores both
    atoms = _molecules()[0]
    atoms.info.update(charge=-2.0, spin=3.0)
    assert petfunc.from_atoms([atoms], config)[2].charge.tolist() == [-2]
    atoms.info.update(charge=0.5)
    plain = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    assert petfunc.from_atoms([atoms], plain)[2].charge.tolist() == [0]


# ---------------------------------------------------------------------------------------
# metatrain checkpoints


def _checkpoint_id(path):
    return os.path.basename(path).replace(".ckpt.gz", "")


def test_all_checkpoints_found():
    names = {_checkpoint_id(p) for p in CHECKPOINTS}
    assert len(CHECKPOINTS) == 34, sorted(names)
    assert {"model-v1_trainer-v1", "model-v8_trainer-v7", "model-v16_trainer-v15"} <= names


@pytest.mark.parametrize("path", CHECKPOINTS, ids=[_checkpoint_id(p) for p in CHECKPOINTS])
def test_checkpoint(path):
    config, params = petfunc.from_metatrain(path, dtype=torch.float64)
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False, map_location="cpu")
    mtt = model_from_checkpoint(checkpoint, context="export").to(torch.float64).eval()
    assert list(mtt.atomic_types) == list(config.atomic_types)
    compare_checkpoint = [_molecules()[0], _cubic_cell()]
    assert config.system_conditioning == ("conditioning" in os.path.basename(path))
    if config.system_conditioning:
        compare_checkpoint[0].info.update(charge=-1, spin_multiplicity=2)
        compare_checkpoint[1].info.update(charge=2, spin=3)
    energy, per_atom, forces, strain = ref.evaluate(mtt, compare_checkpoint)

    model = petfunc.PET(config)
    positions, cell, neighbors = petfunc.from_atoms(compare_checkpoint, config, dtype=torch.float64)
    e, f, w = petfunc.energy_forces_strain_derivative(model.energy)(params, positions, cell, neighbors)
    pa = model.per_atom_energies(params, positions, cell, neighbors)
    comp_atoms, comp_total = composition(params, compare_checkpoint, config)
    # the tiny checkpoints' network energies are small next to the composition: compare
    # the totals relative to themselves too
    assert_close(e, energy, "energy")
    assert_close(e - comp_total, energy - comp_total, "energy - composition", rtol=1e-9)
    assert_close(pa - comp_atoms, per_atom - comp_atoms, "per-atom energy - composition", rtol=1e-9)
    assert_close(f, forces, "forces")
    assert_close(w, strain, "dE/dstrain")


def test_atoms_without_neighbours():
    """Isolated atoms (an empty NEF grid, M = 0) alone and batched with real structures."""
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    params = random_params(config, seed=7)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    far_pair = ase.Atoms("HO", positions=[[0, 0, 0], [20.0, 0, 0]])
    for batch in ([ase.Atoms("N")], [far_pair], [far_pair, _molecules()[0], ase.Atoms("C"), _small_cell()]):
        compare_energies_forces_strain(config, params, mtt, batch)


def test_fractional_adaptive_neighbour_count():
    """petfunc takes any positive num_neighbors_adaptive; metatrain's model computes
    with it as it is (its options type it as an int)."""
    import dataclasses

    base = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    for nu, method in ((2.5, "solver"), (0.7, "grid"), (7.3, "solver")):
        config = dataclasses.replace(
            base, cutoff=5.0, num_neighbors_adaptive=nu, adaptive_cutoff_method=method
        )
        params = random_params(config, seed=11)
        mtt = ref.make_model(config)
        assert mtt.hypers["num_neighbors_adaptive"] == nu
        ref.load_params(mtt, params)
        compare_energies_forces_strain(
            config, params, mtt, [_small_cell(), _molecules()[0]], what=f"nu {nu}: "
        )


# ---------------------------------------------------------------------------------------
# random architectures on random structures


def _random_config(rng):
    """Any combination of metatrain's switches, small widths, random cutoffs."""
    heads = rng.choice([1, 2, 4])
    d_pet = heads * rng.choice([4, 8])
    hypers = dict(
        atomic_types=tuple(sorted(rng.sample([1, 3, 6, 7, 8, 14, 26, 79], rng.randint(1, 5)))),
        d_pet=d_pet,
        num_heads=heads,
        d_node=rng.choice([d_pet, 2 * d_pet, 12]),
        d_head=rng.choice([8, 16]),
        d_feedforward=rng.choice([8, 24]),
        num_gnn_layers=rng.randint(1, 3),
        num_attention_layers=rng.randint(1, 3),
        cutoff=rng.choice([2.5, 3.7, 4.5, 6.0]),
        cutoff_width=rng.choice([0.2, 0.5, 1.0]),
        cutoff_function=rng.choice(["Bump", "Cosine"]),
        normalization=rng.choice(["RMSNorm", "LayerNorm"]),
        activation=rng.choice(["SwiGLU", "SiLU"]),
        transformer_type=rng.choice(["PreLN", "PostLN"]),
        featurizer_type=rng.choice(["feedforward", "residual"]),
        attention_temperature=rng.choice([1.0, 0.7, 1.9]),
    )
    if rng.random() < 0.5:
        hypers.update(
            num_neighbors_adaptive=rng.choice([2, 5, 9, 30]),
            adaptive_cutoff_method=rng.choice(["solver", "grid"]),
            cutoff_width_adaptive=rng.choice([0.5, 1.0]),
        )
    return petfunc.PETConfig(**hypers)


def _random_structure(rng, types):
    """A molecule, a (triclinic) bulk cell, a slab, a wire or a tiny cell whose atoms
    see many of their own images; no two atoms closer than 0.7 Å."""
    from ase.geometry import get_distances

    gen = np.random.default_rng(rng.randint(0, 2**31))
    for _ in range(100):
        kind = rng.choice(["molecule", "bulk", "triclinic", "slab", "wire", "one_atom_cell"])
        n = rng.randint(1, 10)
        numbers = [rng.choice(types) for _ in range(n)]
        if kind == "molecule":
            atoms = ase.Atoms(numbers=numbers, positions=gen.uniform(0, 3.5, (n, 3)))
        elif kind == "one_atom_cell":
            atoms = ase.Atoms(
                numbers=numbers[:1],
                positions=[[0.3, 0.1, 0.2]],
                cell=np.eye(3) * gen.uniform(1.8, 3.0),
                pbc=True,
            )
        else:
            cell = np.diag(gen.uniform(2.0, 6.0, 3))
            if kind == "triclinic":
                cell = cell + gen.uniform(-1.2, 1.2, (3, 3))
            pbc = {"slab": [1, 1, 0], "wire": [0, 0, 1]}.get(kind, [1, 1, 1])
            atoms = ase.Atoms(numbers=numbers, scaled_positions=gen.uniform(0, 1, (n, 3)), cell=cell, pbc=pbc)
        if len(atoms) == 1:
            return atoms
        d = get_distances(atoms.positions, cell=atoms.cell, pbc=atoms.pbc)[1]
        if d[~np.eye(len(atoms), dtype=bool)].min() > 0.7:
            return atoms
    raise RuntimeError("no structure without close contacts")


@pytest.mark.parametrize("seed", range(16))
def test_random_architecture_on_random_structures(seed):
    """Energies, per-atom energies, forces and strain derivatives to 1e-10 relative
    (absolute floor 1e-13: symmetric cells have zero forces) for a random switch
    combination on a random batch of molecules, bulk, slabs and wires."""
    import random

    rng = random.Random(seed)
    config = _random_config(rng)
    batch = [_random_structure(rng, config.atomic_types) for _ in range(rng.randint(1, 4))]
    if seed % 3 == 0:
        config, batch = _conditioned(config, batch, random.Random(1000 + seed))
    params = random_params(config, seed=seed)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare_energies_forces_strain(config, params, mtt, batch, what=f"{config}: ")


@pytest.mark.parametrize("seed", range(3))
def test_atoms_outside_their_cell(seed):
    """Unwrapped positions, as MD trajectories have them: atoms moved by whole
    lattice vectors (up to 3 each way) out of triclinic cells, periodic in 3 or 2
    directions, against metatrain."""
    import random

    from ase.geometry import get_distances

    rng = random.Random(500 + seed)
    gen = np.random.default_rng(seed)
    config = _random_config(rng)
    frames = []
    while len(frames) < 3:
        n = rng.randint(2, 6)
        slab = len(frames) == 1
        cell = np.diag(gen.uniform(3.0, 6.0, 3)) + gen.uniform(-1.0, 1.0, (3, 3))
        atoms = ase.Atoms(
            numbers=[rng.choice(config.atomic_types) for _ in range(n)],
            scaled_positions=gen.uniform(0, 1, (n, 3)),
            cell=cell,
            pbc=[True, True, not slab],
        )
        if (
            get_distances(atoms.positions, cell=atoms.cell, pbc=atoms.pbc)[1][~np.eye(n, dtype=bool)].min()
            < 0.7
        ):
            continue
        shifts = gen.integers(-3, 4, (n, 3)).astype(float)
        if slab:
            shifts[:, 2] = 0.0  # no images along the open direction
        atoms.positions = atoms.positions + shifts @ atoms.cell.array
        assert np.abs(atoms.get_scaled_positions(wrap=False)).max() > 1.0
        frames.append(atoms)
    params = random_params(config, seed=seed)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare_energies_forces_strain(config, params, mtt, frames, what=f"{config}: ")


def test_adaptive_solver_off_its_root():
    """A molecule where metatrain's ten Newton-bisection steps stop on a flat shoulder
    of n_i(r) for two atoms, so the radii depend on round-off. Evaluated in another
    order (r / r_max instead of r * (1 / r_max)), those radii came out 3.7 Å instead
    of metatrain's 2.75 and 2.41 Å and the energy 40 % off; petfunc follows
    metatrain's arithmetic (found by a sweep of the random test above)."""
    config = petfunc.PETConfig(
        atomic_types=(1, 8, 14),
        cutoff=3.7,
        cutoff_width=1.0,
        num_neighbors_adaptive=2,
        adaptive_cutoff_method="solver",
        cutoff_width_adaptive=0.5,
        d_pet=8,
        d_head=8,
        d_node=16,
        d_feedforward=8,
        num_heads=1,
        num_attention_layers=2,
        num_gnn_layers=1,
        activation="SiLU",
        attention_temperature=1.9,
        transformer_type="PostLN",
    )
    positions = [
        [2.2380201458442253, 3.0278616092401665, 1.6762432617307774],
        [3.4426951787979205, 0.8209481495384257, 3.2452432615872278],
        [0.08011454121208039, 3.0440450238618624, 1.9110562090367718],
        [0.2782955739749419, 1.8988412877412102, 1.4434777618361454],
        [2.826667373185006, 0.5168061120786499, 2.633134890246108],
        [1.4316214865414698, 0.23250037300729465, 1.700482792013557],
    ]
    atoms = ase.Atoms(numbers=[14, 8, 14, 14, 1, 1], positions=positions)
    from petfunc.model import edge_vectors
    from petfunc.model.adaptive import atomic_cutoffs

    positions_t, cell, neighbors = petfunc.from_atoms([atoms], config, dtype=torch.float64)
    distances = torch.linalg.vector_norm(edge_vectors(positions_t, cell, neighbors), dim=-1) + 1e-15
    radii = atomic_cutoffs(config, neighbors.centers, distances, neighbors.n_atoms)
    expected = [2.53045427, 2.74971087, 2.40502224, 2.29916991, 2.00927573, 2.29917106]
    assert torch.allclose(radii, torch.tensor(expected, dtype=torch.float64), atol=1e-8), radii
    params = random_params(config, seed=196)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    compare_energies_forces_strain(config, params, mtt, [atoms])


def _conditioned(config, batch, rng):
    """``config`` with charge/spin conditioning, and random charges and spins on ``batch``."""
    import dataclasses

    max_charge, max_spin = rng.choice([0, 1, 4]), rng.choice([1, 2, 5])
    config = dataclasses.replace(
        config, system_conditioning=True, max_charge=max_charge, max_spin_multiplicity=max_spin
    )
    for atoms in batch:
        atoms.info["charge"] = rng.randint(-max_charge, max_charge)
        atoms.info["spin_multiplicity" if rng.random() < 0.5 else "spin"] = rng.randint(1, max_spin)
    return config, batch


def _metatrain_training_outputs(config, params, frames):
    """metatrain's PET with ``params`` in training mode on ``frames`` (float64):
    ``(model, systems, target info, energy TensorMap with position and strain
    gradients kept in the graph)``, as its trainer's evaluate_model gives them."""
    from metatomic.torch import systems_to_torch
    from metatrain.utils.data.target_info import get_energy_target_info
    from metatrain.utils.evaluate_model import evaluate_model
    from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

    model = ref.make_model(config)
    ref.load_params(model, params)
    model.train()
    systems = [
        ref.add_system_data(model, get_system_with_neighbor_lists(s, model.requested_neighbor_lists()), atoms)
        for s, atoms in zip(systems_to_torch(frames, dtype=torch.float64), frames)
    ]
    info = get_energy_target_info(
        "energy", {"quantity": "energy", "unit": "eV"}, add_position_gradients=True, add_strain_gradients=True
    )
    predicted = evaluate_model(model, systems, {"energy": info}, is_training=True)["energy"]
    return model, systems, info, predicted


def _assert_gradients_equal(grads, model, rtol=1e-10):
    """petfunc's parameter gradients against ``model``'s ``.grad`` (after its
    ``loss.backward()``), every trained weight compared."""
    ours = petfunc.tree.flatten(grads)
    compared = set()
    for name, parameter in model.named_parameters():
        key = name.removeprefix("backend.")
        if key in ours:
            reference = parameter.grad if parameter.grad is not None else torch.zeros_like(parameter)
            assert_close(ours[key], reference, key, rtol=rtol)
            compared.add(key)
    assert set(ours) == compared, set(ours) ^ compared


@pytest.mark.parametrize(
    "seed,autodiff,per_atom,override",
    [(seed, autodiff, True, {}) for seed in range(4) for autodiff in ("func", "autograd")]
    + [
        (4, "func", False, {}),
        (5, "autograd", False, {}),
        # no attention layer; no GNN layer (the embeddings read out)
        (6, "func", True, {"num_attention_layers": 0}),
        (7, "func", True, {"num_gnn_layers": 0, "featurizer_type": "feedforward"}),
    ],
)
def test_random_architecture_training_gradients(seed, autodiff, per_atom, override):
    """Parameter gradients of the energy + forces + strain-derivative loss equal
    metatrain's training-mode gradients (its evaluate_model, create_graph=True,
    loss.backward) for random architectures on random labelled batches; with
    ``per_atom=False`` the energy and strain terms compare whole structures
    (metatrain's per_structure_targets: average_by_num_atoms leaves them whole)."""
    import dataclasses
    import random

    from petfunc.data import make_batch, sample_from_atoms

    rng = random.Random(100 + seed)
    config = dataclasses.replace(_random_config(rng), **override)
    frames = [_random_structure(rng, config.atomic_types) for _ in range(rng.randint(2, 4))]
    if seed % 2 == 1:
        config, frames = _conditioned(config, frames, random.Random(2000 + seed))
    params = random_params(config, seed=seed)
    labels = np.random.default_rng(seed)
    samples = []
    for atoms in frames:
        s = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        s.energy = float(10 * labels.normal())
        s.forces = labels.normal(size=(len(atoms), 3))
        s.virial = labels.normal(size=(3, 3))
        samples.append(s)
    flat = petfunc.tree.flatten(params)
    batch = make_batch(
        samples,
        config,
        flat["composition_weights"].numpy(),
        float(flat["energy_scale"]),
        dtype=torch.float64,
        pad=False,
    )
    weights = petfunc.LossWeights.make(energy=1.0, forces=2.0, stress=0.5, per_atom=per_atom)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(config), weights, autodiff)(params, batch)

    model, systems, info, predicted = _metatrain_training_outputs(config, params, frames)
    out = predicted.block()
    n = torch.tensor([len(a) for a in frames], dtype=torch.float64)
    if not per_atom:
        n = torch.ones_like(n)
    loss = (
        ((out.values[:, 0] - batch.energy) / n).pow(2).mean()
        + 2.0 * (out.gradient("positions").values[:, :, 0] + batch.forces).pow(2).mean()
        + 0.5
        * ((out.gradient("strain").values[:, :, :, 0] - batch.strain_derivative) / n[:, None, None])
        .pow(2)
        .mean()
    )
    loss.backward()
    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * loss.item()
    _assert_gradients_equal(grads, model)


LOSS_FORMS = [
    "huber",
    {
        "energy": {
            "type": "mae",
            "weight": 2.0,
            "forces": {"type": "huber", "delta": 0.3, "weight": 3.0},
            "stress": {"type": "mse", "weight": 0.5},
        }
    },
    {
        "energy": {
            "type": "huber",
            "delta": 0.05,
            "reduction": "sum",
            "gradients": {"positions": {"reduction": "sum"}, "strain": {"type": "mae", "reduction": "sum"}},
        }
    },
]


def _target_block(template, energy, forces, strain_derivative):
    """A metatensor block of labels shaped like metatrain's prediction ``template``
    (energies, and their position and strain gradients)."""
    from metatensor.torch import TensorBlock

    block = TensorBlock(
        values=energy[:, None], samples=template.samples, components=[], properties=template.properties
    )
    for name, values in (("positions", -forces), ("strain", strain_derivative)):
        gradient = template.gradient(name)
        block.add_gradient(
            name,
            TensorBlock(
                values=values[..., None].clone(),
                samples=gradient.samples,
                components=gradient.components,
                properties=gradient.properties,
            ),
        )
    return block


@pytest.mark.parametrize("per_atom", [True, False], ids=["per_atom", "per_structure"])
@pytest.mark.parametrize("form", range(len(LOSS_FORMS)), ids=["huber", "mixed", "sum"])
def test_loss_equals_metatrains_loss_aggregator(form, per_atom):
    """The loss and its parameter gradients equal those of metatrain's own trainer
    code, not a re-statement of it: metatrain's expand_loss_config on the loss option,
    its average_by_num_atoms on predictions and labels (per_structure_targets: energy
    when per_atom is off), and its LossAggregator (mse, mae and huber terms with
    their deltas, weights and reductions), on labels with NaN entries, which both
    skip. Random architecture and structures, float64, gradients to 1e-10."""
    import random

    from metatensor.torch import TensorMap
    from metatrain.utils.loss import LossAggregator
    from metatrain.utils.omegaconf import expand_loss_config
    from metatrain.utils.per_atom import average_by_num_atoms
    from omegaconf import OmegaConf

    from petfunc.data import make_batch, sample_from_atoms
    from petfunc.trainer.options import parse_loss

    rng = random.Random(300 + form)
    config = _random_config(rng)
    frames = [_random_structure(rng, config.atomic_types) for _ in range(rng.randint(3, 5))]
    params = random_params(config, seed=form)
    labels = np.random.default_rng(form)
    samples = []
    for n, atoms in enumerate(frames):
        s = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        s.energy = float(labels.normal()) if n != 1 else float("nan")
        s.forces = labels.normal(size=(len(atoms), 3))
        s.forces[labels.random(size=s.forces.shape) < 0.2] = np.nan
        s.virial = labels.normal(size=(3, 3)) if n != 2 else np.full((3, 3), np.nan)
        samples.append(s)
    flat = petfunc.tree.flatten(params)
    batch = make_batch(
        samples,
        config,
        flat["composition_weights"].numpy(),
        float(flat["energy_scale"]),
        dtype=torch.float64,
        pad=False,
    )
    assert torch.isnan(batch.energy).any() and torch.isnan(batch.forces).any()

    spec = LOSS_FORMS[form]
    targets = {"energy": {"quantity": "energy", "forces": {"key": "forces"}, "stress": {"key": "stress"}}}
    conf = OmegaConf.create(
        {"training_set": [{"targets": targets}], "architecture": {"training": {"loss": spec}}}
    )
    loss_config = OmegaConf.to_container(expand_loss_config(conf)["architecture"]["training"]["loss"])
    weights, _ = parse_loss(spec)
    weights = petfunc.LossWeights(weights.energy, weights.forces, weights.stress, per_atom=per_atom)
    grads, metrics = petfunc.make_grad_step(petfunc.PET(config), weights, "func")(params, batch)

    model, systems, info, predicted = _metatrain_training_outputs(config, params, frames)
    target = TensorMap(
        predicted.keys,
        [_target_block(predicted.block(), batch.energy, batch.forces, batch.strain_derivative)],
    )
    per_structure = [] if per_atom else ["energy"]
    predictions = average_by_num_atoms({"energy": predicted}, systems, per_structure)
    references = average_by_num_atoms({"energy": target}, systems, per_structure)
    loss = LossAggregator({"energy": info}, loss_config)(predictions, references)
    loss.backward()

    assert abs(loss.item() - metrics["loss"].item()) <= 1e-12 * abs(loss.item()), (
        loss.item(),
        metrics["loss"],
    )
    _assert_gradients_equal(grads, model)


# ---------------------------------------------------------------------------------------
# composition weights, energy scale and the validation split, as metatrain fits them


def _emt_molecules(n, names, seed):
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    noise = np.random.default_rng(seed)
    frames = []
    for i in range(n):
        atoms = ase.build.molecule(names[i % len(names)])
        atoms.rattle(0.05, seed=100 * seed + i)
        atoms.calc = EMT()
        energy = atoms.get_potential_energy() + 0.1 * noise.normal()
        atoms.calc = SinglePointCalculator(atoms, energy=energy)
        frames.append(atoms)
    return frames


@pytest.mark.parametrize(
    "names", [("CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H6"), ("CH3CH2OH",)], ids=["mixed", "collinear"]
)
@pytest.mark.parametrize("batch_size", [16, 5])
def test_composition_and_scale_equal_metatrain(tmp_path, names, batch_size):
    """Bitwise the weights and scale of metatrain's composition model and scaler
    (train_or_load_*), with a species absent from the data. Every structure being
    C2H6O makes the fit singular: the 1e-14 ridge then decides the weights (they
    differ by ~1e-2 with another ridge), so it must be metatrain's."""
    import ase.io
    import metatensor.torch as mts
    from metatrain.composition import train_or_load_composition_model
    from metatrain.scaler import train_or_load_scaler
    from metatrain.utils.data import get_dataset
    from omegaconf import OmegaConf

    from petfunc.data import fit_composition, fit_scale, sample_from_atoms

    frames = _emt_molecules(37, names, seed=batch_size)
    path = str(tmp_path / "data.xyz")
    ase.io.write(path, frames)
    target = {
        "quantity": "energy",
        "read_from": path,
        "reader": None,
        "key": "energy",
        "unit": "eV",
        "per_atom": False,
        "type": "scalar",
        "num_subtargets": 1,
        "description": "",
        "forces": False,
        "stress": False,
        "virial": False,
    }
    dataset, _, _ = get_dataset(
        OmegaConf.create(
            {
                "systems": {"read_from": path, "reader": None, "length_unit": "angstrom"},
                "targets": {"energy": target},
            }
        )
    )
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8, 14), **SMALL)
    model = ref.make_model(config)
    train_or_load_composition_model(model.additive_models[0], {}, [dataset], [], batch_size, False)
    train_or_load_scaler(model.scaler, [dataset], model.additive_models, batch_size, False)
    expected_w = mts.load_buffer(model.additive_models[0].energy_composition_buffer).block().values.flatten()
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]

    samples = [
        sample_from_atoms(a, config, energy_key="energy", forces_key=None, stress_key=None) for a in frames
    ]
    w = fit_composition(samples, config.num_species, batch_size)
    assert np.array_equal(w, expected_w.numpy()), (w, expected_w)
    assert w[-1] == 0.0  # Si never appears
    assert fit_scale(samples, w) == pytest.approx(float(expected_c), rel=1e-14)
    # per_structure_targets: [energy]: the RMS of the per-structure residual
    model = ref.make_model(config)
    train_or_load_composition_model(model.additive_models[0], {}, [dataset], [], batch_size, False)
    train_or_load_scaler(
        model.scaler, [dataset], model.additive_models, batch_size, False, per_structure_targets=["energy"]
    )
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]
    assert fit_scale(samples, w, per_atom=False) == pytest.approx(float(expected_c), rel=1e-14)
    assert abs(fit_scale(samples, w, per_atom=False) / fit_scale(samples, w) - 1) > 0.5  # a different scale


def test_validation_split_equals_mtt_train():
    """Regression values from ``mtt train`` (metatrain 2026.4.1, seed 7, 21 structures,
    ``validation_set: 0.3``, default ``test_set: 0``): its indices/training.txt and
    validation.txt, in their order."""
    from petfunc.data.read import split_datasets, split_indices

    train, val = split_indices(21, 0.3, seed=7)
    assert train.tolist() == [20, 5, 11, 2, 0, 8, 1, 12, 19, 16, 6, 13, 9, 10, 18]
    assert val.tolist() == [17, 14, 7, 3, 4, 15]
    # a separate validation file: metatrain's test split still reshuffles the training set
    train, val = split_indices(5, None, seed=7)
    assert sorted(train.tolist()) == list(range(5)) and len(val) == 0
    # a fraction below 1/n: no validation structure (metatrain warns, so does petfunc)
    train, val = split_indices(5, 0.1, seed=7)
    assert sorted(train.tolist()) == list(range(5)) and len(val) == 0
    # two training files (21 and 18 structures), seed 7, validation_set: 0.3:
    # indices/training_{0,1}.txt and validation_{0,1}.txt of that mtt train run
    (t0, v0, _), (t1, v1, _) = split_datasets([21, 18], 0.3, seed=7)
    assert t0.tolist() == [6, 13, 11, 16, 12, 18, 9, 2, 20, 19, 0, 10, 8, 5, 1]
    assert v0.tolist() == [17, 14, 7, 3, 4, 15]
    assert t1.tolist() == [10, 11, 16, 0, 14, 6, 1, 2, 17, 3, 13, 4, 9]
    assert v1.tolist() == [7, 15, 8, 5, 12]
    # with a test set: the training, validation and test .txt of mtt train runs
    # (seed 7) with validation_set: 0.3 and test_set: 0.2 (one file of 21)...
    ((train, val, test),) = split_datasets([21], 0.3, seed=7, test_fraction=0.2)
    assert train.tolist() == [20, 5, 11, 2, 0, 8, 1, 12, 19, 16, 6]
    assert val.tolist() == [17, 14, 7, 3, 4, 15] and test.tolist() == [13, 9, 10, 18]
    # ... test_set: 0.15 of two files (21 and 18) ...
    (t0, v0, s0), (t1, v1, s1) = split_datasets([21, 18], 0.3, seed=7, test_fraction=0.15)
    assert t0.tolist() == [6, 13, 11, 16, 12, 18, 9, 2, 20, 19, 0, 10] and s0.tolist() == [8, 5, 1]
    assert t1.tolist() == [10, 11, 16, 0, 14, 6, 1, 2, 17, 3, 13] and s1.tolist() == [4, 9]
    assert v0.tolist() == [17, 14, 7, 3, 4, 15] and v1.tolist() == [7, 15, 8, 5, 12]
    # ... and a separate validation file with test_set: 0.25
    ((train, val, test),) = split_datasets([21], None, seed=7, test_fraction=0.25)
    assert train.tolist() == [1, 5, 2, 18, 11, 13, 0, 19, 6, 20, 16, 12, 10, 9, 8, 17]
    assert val.tolist() == [] and test.tolist() == [14, 7, 3, 4, 15]


def test_several_training_files(tmp_path):
    """``training_set`` as a list of files, one without forces and stresses: the fitted
    composition and scale equal metatrain's (train_or_load_* on the same split of
    each file, batched per file), the split is metatrain's, and the file without
    forces trains with NaN force labels (skipped by the loss)."""
    import ase.io
    import metatensor.torch as mts
    from metatrain.composition import train_or_load_composition_model
    from metatrain.scaler import train_or_load_scaler
    from metatrain.utils.data import get_dataset
    from omegaconf import OmegaConf
    from torch.utils.data import Subset

    from petfunc.cli.commands import make_default_dataset
    from petfunc.data.read import split_datasets
    from petfunc.trainer.training import fit

    first = make_default_dataset(tmp_path / "cells.xyz", n_structures=11, seed=1)
    frames = ase.io.read(make_default_dataset(tmp_path / "more.xyz", n_structures=9, seed=2), ":")
    for atoms in frames:
        atoms.calc = type(atoms.calc)(atoms, energy=atoms.get_potential_energy())
    second = tmp_path / "energies.xyz"
    ase.io.write(second, frames)
    batch_size = 4
    options = {
        "seed": 5,
        "architecture": {
            "name": "pet",
            "model": dict(
                SMALL,
                d_pet=8,
                d_node=8,
                d_head=8,
                d_feedforward=8,
                num_gnn_layers=1,
                num_attention_layers=1,
                cutoff=3.0,
            ),
            "training": {"batch_size": batch_size, "num_epochs": 1},
        },
        "training_set": [str(first), {"systems": str(second), "targets": {"energy": {"key": "energy"}}}],
        "validation_set": 0.25,
    }
    lines = []
    result = fit(options, None, progress=False, log=lines.append)
    assert any(
        "training set: 16 structures" in line and "validation set: 4 structures" in line for line in lines
    ), lines
    # batches of one file each, as metatrain's combined loader: 9 // 4 + 7 // 4 = 3
    # steps (batches mixing the files would make 16 // 4 = 4)
    assert any("3 steps per epoch" in line for line in lines), lines
    assert np.isfinite(result.history[-1]["train_loss"]), result.history[-1]

    subsets = []
    for path, (train, _, _) in zip((first, second), split_datasets([11, 9], 0.25, seed=5)):
        target = {
            "quantity": "energy",
            "read_from": str(path),
            "reader": None,
            "key": "energy",
            "unit": "eV",
            "per_atom": False,
            "type": "scalar",
            "num_subtargets": 1,
            "description": "",
            "forces": False,
            "stress": False,
            "virial": False,
        }
        dataset, _, _ = get_dataset(
            OmegaConf.create(
                {
                    "systems": {"read_from": str(path), "reader": None, "length_unit": "angstrom"},
                    "targets": {"energy": target},
                }
            )
        )
        subsets.append(Subset(dataset, train.tolist()))
    model = ref.make_model(result.config)
    train_or_load_composition_model(model.additive_models[0], {}, subsets, [], batch_size, False)
    train_or_load_scaler(model.scaler, subsets, model.additive_models, batch_size, False)
    expected_w = mts.load_buffer(model.additive_models[0].energy_composition_buffer).block().values.flatten()
    expected_c = mts.load_buffer(model.scaler.energy_per_target_scaler_buffer).block().values.flatten()[0]
    assert torch.equal(result.params["composition_weights"], expected_w)
    assert float(result.params["energy_scale"]) == pytest.approx(float(expected_c), rel=1e-14)

    # one validation file per training file, or an error that says so
    options["validation_set"] = [str(second)]
    with pytest.raises(ValueError, match="lists 1 dataset.*'training_set' lists 2"):
        fit(options, None, progress=False, log=quiet_log)
    options["validation_set"] = 0.25
    options["training_set"][1] = str(tmp_path / "missing.xyz")
    with pytest.raises(FileNotFoundError, match=r"training_set\[1\]: dataset file not found"):
        fit(options, None, progress=False, log=quiet_log)


def quiet_log(message):
    pass


def test_max_atoms_per_batch_equals_metatrain_sampler():
    """``max_atoms_per_batch``: the batches of every epoch (and of each of 2 ranks)
    are those of metatrain's ``MaxAtomDistributedBatchSampler`` on the same atom
    counts, with and without ``min_atoms``, oversized structures skipped."""
    from metatrain.utils.data.samplers import MaxAtomDistributedBatchSampler

    from petfunc.data.batching import batch_plan

    class Counts(torch.utils.data.Dataset):
        def __init__(self, counts):
            self.counts = counts

        def __len__(self):
            return len(self.counts)

        def get_num_atoms(self, i):
            return int(self.counts[i])

    counts = np.random.default_rng(4).integers(1, 40, size=57)
    counts[[3, 30]] = 70  # larger than max_atoms: skipped in training
    for max_atoms, min_atoms, world in ((64, 0, 1), (64, 30, 1), (100, 0, 2), (41, 10, 3)):
        for rank in range(world):
            sampler = MaxAtomDistributedBatchSampler(
                Counts(counts),
                max_atoms,
                num_replicas=world,
                rank=rank,
                shuffle=True,
                drop_last=True,
                min_atoms=min_atoms,
            )
            for epoch in (0, 1, 5):
                sampler.set_epoch(epoch)
                expected = [list(b) for b in sampler]
                plan = batch_plan(
                    len(counts),
                    8,
                    epoch=epoch,
                    seed=123,
                    rank=rank,
                    world_size=world,
                    atom_counts=counts,
                    max_atoms=max_atoms,
                    min_atoms=min_atoms,
                )
                assert [b.tolist() for b in plan] == expected, (max_atoms, min_atoms, world, rank, epoch)
    # evaluation keeps every structure once, an oversized one alone
    plan = batch_plan(len(counts), 8, shuffle=False, drop_last=False, atom_counts=counts, max_atoms=64)
    assert sorted(np.concatenate(plan).tolist()) == list(range(len(counts)))
    assert [3] in [b.tolist() for b in plan] and all(counts[b].sum() <= 64 for b in plan if len(b) > 1)


@pytest.mark.parametrize(
    "epochs,steps_per_epoch,warmup_fraction",
    [(1, 1, 0.01), (3, 7, 0.1), (50, 13, 0.01), (10, 4, 0.0), (2, 5, 0.5)],
)
def test_schedule_equals_metatrains(epochs, steps_per_epoch, warmup_fraction):
    """petfunc.warmup_cosine(lr, T, f) against the learning rates of metatrain's PET
    trainer (its get_scheduler: LambdaLR, stepped once per batch) at every step."""
    from metatrain.pet.trainer import get_scheduler

    learning_rate = 3e-4
    weight = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.Adam([weight], lr=learning_rate)
    hypers = {"num_epochs": epochs, "warmup_fraction": warmup_fraction}
    scheduler = get_scheduler(optimizer, hypers, steps_per_epoch)
    schedule = petfunc.warmup_cosine(learning_rate, epochs * steps_per_epoch, warmup_fraction)
    for step in range(epochs * steps_per_epoch):
        expected = optimizer.param_groups[0]["lr"]  # the rate of this step's update
        assert abs(schedule(step).item() - expected) <= 1e-15 * learning_rate, step
        optimizer.step()
        scheduler.step()
