"""petfunc against metatrain's own eager PET on the same weights (float64): the
default architecture, every architecture switch, charge and spin conditioning,
atoms without neighbours, fractional adaptive neighbour counts, an adaptive cutoff
off its root.

Energies, per-atom energies, forces and strain derivatives (stress) agree to 1e-10
relative. Energies are compared without the composition term (it is large and
identical on both sides by construction): ``E - sum_i w_{Z_i}`` and ``e_i - w_{Z_i}``.
"""

import dataclasses

import ase
import ase.build
import pytest
import torch


pytest.importorskip("metatrain")

import petfunc
from tests.helpers import mtt_reference as ref
from tests.helpers.parity import (
    SMALL,
    compare,
    compare_energies_forces_strain,
    frames,
    molecules,
    random_params,
    small_cell,
)


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
    # settings metatrain builds, degenerate ones included
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


# ---------------------------------------------------------------------------------------
# edge cases


def test_atoms_without_neighbours():
    """Isolated atoms (an empty NEF grid, M = 0) alone and batched with real structures."""
    config = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    params = random_params(config, seed=7)
    mtt = ref.make_model(config)
    ref.load_params(mtt, params)
    far_pair = ase.Atoms("HO", positions=[[0, 0, 0], [20.0, 0, 0]])
    for batch in ([ase.Atoms("N")], [far_pair], [far_pair, molecules()[0], ase.Atoms("C"), small_cell()]):
        compare_energies_forces_strain(config, params, mtt, batch)


def test_fractional_adaptive_neighbour_count():
    """petfunc takes any positive num_neighbors_adaptive; metatrain's model computes
    with it as it is (its options type it as an int)."""

    base = petfunc.PETConfig(atomic_types=(1, 6, 7, 8), **SMALL)
    for nu, method in ((2.5, "solver"), (0.7, "grid"), (7.3, "solver")):
        config = dataclasses.replace(
            base, cutoff=5.0, num_neighbors_adaptive=nu, adaptive_cutoff_method=method
        )
        params = random_params(config, seed=11)
        mtt = ref.make_model(config)
        assert mtt.hypers["num_neighbors_adaptive"] == nu
        ref.load_params(mtt, params)
        compare_energies_forces_strain(config, params, mtt, [small_cell(), molecules()[0]], what=f"nu {nu}: ")


def test_adaptive_solver_off_its_root():
    """A molecule where metatrain's ten Newton-bisection steps stop on a flat shoulder
    of n_i(r) for two atoms, so the radii depend on round-off. Evaluated in another
    order (r / r_max instead of r * (1 / r_max)), those radii come out 3.7 Å instead
    of metatrain's 2.75 and 2.41 Å and the energy 40 % off; petfunc follows
    metatrain's arithmetic."""
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
