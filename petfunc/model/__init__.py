"""PET's model math, as pure functions of parameters and positions.

- :mod:`petfunc.model.pet`: the network, :class:`PET` and ``energy(params, positions,
  cell, neighbors)``; :mod:`petfunc.model.params`: :func:`init` and
  :func:`check_params`.
- :mod:`petfunc.model.geometry`: edge vectors and cutoff factors;
  :mod:`petfunc.model.cutoff`, :mod:`petfunc.model.adaptive`: switching functions and
  the adaptive cutoff radii.
- :mod:`petfunc.model.nn`, :mod:`petfunc.model.transformer`: layers and attention.
- :mod:`petfunc.model.zbl`: the ZBL repulsion; :mod:`petfunc.model.long_range`: the
  long-range Coulomb features (Ewald, P3M, direct sums).
"""

from petfunc.model.geometry import cutoff_factors as cutoff_factors
from petfunc.model.geometry import edge_vectors as edge_vectors
from petfunc.model.params import BLOCK as BLOCK
from petfunc.model.params import EXTRA_KEYS as EXTRA_KEYS
from petfunc.model.params import TARGET as TARGET
from petfunc.model.params import check_params as check_params
from petfunc.model.params import expected_shapes as expected_shapes
from petfunc.model.params import init as init
from petfunc.model.params import init_conditioning as init_conditioning
from petfunc.model.pet import PET as PET
from petfunc.model.pet import atomic_energies as atomic_energies
from petfunc.model.pet import conditioning as conditioning
from petfunc.model.pet import energy as energy
from petfunc.model.pet import energy_terms as energy_terms
from petfunc.model.pet import last_layer_features as last_layer_features
from petfunc.model.pet import per_atom_energies as per_atom_energies
from petfunc.model.pet import raw_energy as raw_energy
