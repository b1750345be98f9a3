"""The structures, random parameters and comparisons of the parity tests with
metatrain's own eager PET (tests/parity/). Needs metatrain (tests/helpers/mtt_reference.py)."""

import dataclasses
import glob
import os

import ase
import ase.build
import numpy as np
import torch
from ase.geometry import get_distances

import petfunc
from tests.helpers import mtt_reference as ref


RTOL = 1e-10
CHECKPOINT_DIR = os.path.join(
    os.path.dirname(__import__("metatrain.pet", fromlist=["_"]).__file__), "tests", "checkpoints"
)


CHECKPOINTS = sorted(glob.glob(os.path.join(CHECKPOINT_DIR, "*.ckpt.gz")))
SMALL = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2)


# ---------------------------------------------------------------------------------------
# structures


def molecules():
    """Ethanol and acetamide (H, C, N, O), rattled."""
    ethanol = ase.build.molecule("CH3CH2OH")
    ethanol.rattle(0.05, seed=1)
    acetamide = ase.build.molecule("CH3CONH2")  # has N: every species of (1, 6, 7, 8)
    acetamide.rattle(0.05, seed=2)
    return [ethanol, acetamide]


def small_cell():
    """2-atom primitive diamond: lattice vectors of 2.5 A, far below the 4.5 A cutoff."""
    atoms = ase.build.bulk("C", "diamond", a=3.57)
    atoms.rattle(0.05, seed=3)
    return atoms


def cubic_cell():
    """The 8-atom cubic diamond cell with two N, rattled."""
    atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    atoms.symbols[[1, 6]] = "N"
    atoms.rattle(0.08, seed=4)
    return atoms


def slab():
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
    """Two molecules, two cells and a slab."""
    return molecules() + [small_cell(), cubic_cell(), slab()]


# ---------------------------------------------------------------------------------------
# comparisons


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
    """The composition energies ``(per atom [N], per structure [S])`` of ``frames_``."""
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
# random architectures and structures


def random_config(rng):
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


def random_structure(rng, types):
    """A molecule, a (triclinic) bulk cell, a slab, a wire or a tiny cell whose atoms
    see many of their own images; no two atoms closer than 0.7 Å."""
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


def conditioned(config, batch, rng):
    """``config`` with charge/spin conditioning, and random charges and spins on ``batch``."""
    max_charge, max_spin = rng.choice([0, 1, 4]), rng.choice([1, 2, 5])
    config = dataclasses.replace(
        config, system_conditioning=True, max_charge=max_charge, max_spin_multiplicity=max_spin
    )
    for atoms in batch:
        atoms.info["charge"] = rng.randint(-max_charge, max_charge)
        atoms.info["spin_multiplicity" if rng.random() < 0.5 else "spin"] = rng.randint(1, max_spin)
    return config, batch


# ---------------------------------------------------------------------------------------
# training


def metatrain_training_outputs(config, params, frames):
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


def assert_gradients_equal(grads, model, rtol=1e-10):
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
