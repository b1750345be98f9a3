"""The eager neighbour graph: the integer inputs of PET, built outside traced code.

Everything whose shape depends on the data lives here: the flat edge list
(:mod:`petfunc.graph.neighbors`, built with vesin), PET's token layout (kept edges,
their NEF grid, reverse edges), the long-range k-grids, meshes and pairs
(:mod:`petfunc.graph.long_range`), the checks that refuse a structure before any
of it is built (:mod:`petfunc.graph.checks`), and the frame the model computes in
(:mod:`petfunc.graph.frame`). The energy function sees only tensors.
"""

from petfunc.graph.checks import COINCIDENT as COINCIDENT
from petfunc.graph.checks import MAX_NEIGHBORS_ESTIMATE as MAX_NEIGHBORS_ESTIMATE
from petfunc.graph.checks import check_coincident as check_coincident
from petfunc.graph.checks import check_density as check_density
from petfunc.graph.checks import check_sizes as check_sizes
from petfunc.graph.checks import check_structure as check_structure
from petfunc.graph.checks import wrapped as wrapped
from petfunc.graph.frame import check_rigid_motion as check_rigid_motion
from petfunc.graph.frame import model_frame as model_frame
from petfunc.graph.long_range import LeadingMeshes as LeadingMeshes
from petfunc.graph.long_range import LongRange as LongRange
from petfunc.graph.long_range import check_periodicity as check_periodicity
from petfunc.graph.long_range import mesh_layout as mesh_layout
from petfunc.graph.neighbors import Neighbors as Neighbors
from petfunc.graph.neighbors import edge_list as edge_list
from petfunc.graph.neighbors import nef_layout as nef_layout
from petfunc.graph.neighbors import reverse_edges as reverse_edges
from petfunc.graph.neighbors import species_index as species_index
