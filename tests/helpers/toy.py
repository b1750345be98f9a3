"""A small message-passing energy with PET's data layout, for fast compile tests.

It uses the operations whose vmap batching rules needed care in PET (gathers of
positions, ``cat`` of member-dependent with shared tensors, layer norm, slicing,
``scatter_add`` into structure sums, SiLU MLPs), but traces into a graph ten times
smaller than PET's, so compiled tests of ensembles and third derivatives stay quick.
"""

import ase.build
import numpy as np
import torch
from ase.calculators.emt import EMT

from petfunc.data import make_batch, sample_from_atoms
from petfunc.model import edge_vectors, nn
from petfunc.model.cutoff import cosine


N_RBF = 4
WIDTH = 8


def init(num_species: int = 4, seed: int = 0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return {
        "embedding": nn.init_embedding(num_species, WIDTH - N_RBF, g, dtype, None),
        "norm": {
            "weight": 1.0 + 0.1 * torch.randn(WIDTH, generator=g, dtype=dtype),
            "bias": 0.1 * torch.randn(WIDTH, generator=g, dtype=dtype),
        },
        "mlp": nn.init_mlp2(WIDTH, WIDTH, WIDTH, g, dtype, None),
        "readout": nn.init_linear(WIDTH - 1, 1, g, dtype, None),
        "composition_weights": torch.zeros(num_species, dtype=dtype),
        "energy_scale": torch.ones((), dtype=dtype),
    }


def energy(params, positions, cell, neighbors, cutoff: float = 4.0):
    """``[n_structures]`` energies."""
    vectors = edge_vectors(positions, cell, neighbors)
    distances = torch.sqrt((vectors**2).sum(-1) + 1e-12)
    centers = torch.linspace(0.8, cutoff, N_RBF, dtype=positions.dtype)
    rbf = torch.exp(-((distances[:, None] - centers) ** 2))
    species = nn.embedding(params["embedding"], neighbors.species[neighbors.neighbors])
    h = torch.cat([rbf, species], dim=1)  # [n_edges, WIDTH]
    h = nn.layer_norm(params["norm"], h)
    h = nn.mlp2(params["mlp"], h, final_activation=True)[:, 1:]  # slice: slice_backward
    # a weighted sum, not a [.., 7] x [7, 1] matmul: the backward of the latter is an
    # outer product, which inductor's CPU mm decomposition guards on (a recompile
    # whenever n_edges + 7 crosses 32)
    readout = params["readout"]
    per_edge = ((h * readout["weight"][0]).sum(-1) + readout["bias"][0]) * cosine(distances, cutoff, 1.0)
    per_atom = torch.zeros_like(positions[:, 0]).scatter_add(0, neighbors.centers, per_edge)
    per_atom = params["energy_scale"] * per_atom + params["composition_weights"][neighbors.species]
    out = torch.zeros(cell.shape[0], dtype=positions.dtype)
    return out.scatter_add(0, neighbors.structure_index, per_atom)


# ---------------------------------------------------------------------------------------
# labelled batches (EMT labels on rattled molecules and diamond cells)


MOLECULES = ("CH3CH2OH", "H2O", "CH4", "C2H6", "CH3OH", "NH3")


def frames(n: int, seed: int = 0, repeat=(1, 1, 1)):
    """``n`` rattled structures with EMT labels: diamond cells and small molecules."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        if i % 2 == 0:
            atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=bool(rng.integers(2))).repeat(repeat)
        else:
            atoms = ase.build.molecule(MOLECULES[int(rng.integers(len(MOLECULES)))])
        atoms.rattle(0.05, seed=int(rng.integers(1 << 20)))
        atoms.calc = EMT()
        atoms.get_forces()
        if atoms.pbc.all():
            atoms.get_stress()
        out.append(atoms)
    return out


def labelled_batch(config, n: int, seed: int = 0, repeat=(1, 1, 1), dtype=torch.float64):
    """A padded training batch of ``n`` EMT-labelled structures (composition 0, scale 1)."""
    samples = [sample_from_atoms(a, config) for a in frames(n, seed, repeat)]
    return make_batch(samples, config, np.zeros(config.num_species), 1.0, dtype=dtype)
