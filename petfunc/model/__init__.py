"""petfunc.model."""

from petfunc.model.pet import (
    BLOCK,
    PET,
    TARGET,
    atomic_energies,
    conditioning,
    cutoff_factors,
    edge_vectors,
    energy,
    energy_terms,
    init,
    init_conditioning,
    last_layer_features,
    per_atom_energies,
    raw_energy,
)
