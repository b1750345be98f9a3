"""Deployment artifacts: a PET with its weights, as one file that runs without petfunc.

:func:`export_model` writes a model in the format its file name says
(:mod:`petfunc.export.formats`): a metatomic model (``.pt``, for LAMMPS, i-PI, ASE
and torch-sim through metatomic: :func:`export_metatomic`, with the ``metatrain``
extra), a metatrain checkpoint (``.ckpt``), or petfunc's own PT2 archive (``.pt2``),
described below.

:func:`export` writes a PT2 archive (``torch.export``'s package format, a zip file)
holding the pure function

    ``(positions, cell, *neighbors) -> (energy, energies, forces, strain_derivative)``

with the weights inside as constants:

* ``models/model``: the ``torch.export`` ``ExportedProgram`` (aten ops, dynamic sizes);
* with ``aoti=True`` (the default for the CPU), the same program compiled ahead of
  time by AOTInductor for the chosen device: a shared library plus weights, loadable
  from Python (``torch._inductor.aoti_load_package``) or from C++
  (``torch::inductor::AOTIModelPackageLoader``), without Python model code. For a
  GPU the default is the program alone: the one AOTInductor build for a GPU tried
  so far (H200, torch 2.11) crashed the process that loaded it, inside torch's
  package loader, while the program ran there and equalled eager;
* ``extra/petfunc.json``: the model hypers (cutoff, adaptive cutoff, atomic types:
  everything needed to build the neighbour inputs), dtype, device and the input and
  output contract below.

The graph is built like every compiled petfunc function: ``make_fx`` of
:func:`petfunc.derivatives.energy_terms_forces_strain_derivative` (forces and the strain
derivative by ``torch.func.grad``, adaptive-cutoff terms included) on inputs with
symbolic sizes, then ``torch.export`` with every data size dynamic. One artifact
serves any number of structures, atoms, edges and neighbours.

Inputs (sizes: S structures, N atoms, E edges, K kept edges, M NEF width; every size
must be at least 2: add :func:`petfunc.structures.padding_structure` to a single structure,
as :class:`petfunc.ase.PETCalculator` does):

==================  ==============  =========================================
``positions``       [N, 3] float    Å
``cell``            [S, 3, 3] float rows are lattice vectors, zero if not periodic
``species`` ...     see :class:`petfunc.graph.neighbors.Neighbors` (12 integer/bool tensors,
                                    in its field order, ``species`` to
                                    ``spin_multiplicity``)
==================  ==============  =========================================

Models with long-range features take the integer inputs of
:class:`petfunc.graph.LongRange` after those, for the reciprocal-space method
chosen at export (``long_range``, recorded in the metadata):

* ``"p3m"`` (the default; what metatrain, :func:`petfunc.from_atoms` and the ASE
  calculator evaluate with): ``lr_structure_atoms``, ``lr_structure_mask``,
  ``lr_atom_slot``, ``lr_periodic``, ``lr_mesh_sizes``, ``lr_mesh`` (the
  ``[n_a, n_b, n_c]`` mesh of the first structure; a ``[2, 2, 2]`` tensor when it
  is a molecule), ``lr_pairs``, ``lr_pair_mask``. FFT sizes cannot vary per
  structure inside one graph, so **only the first structure of a call may be
  periodic**: one crystal (with any number of molecules after it), as the ASE
  calculator evaluates, or molecules only;
* ``"ewald"`` (what metatrain trains with): the same with ``lr_kgrid`` in place of
  the two mesh inputs, for batches of any number of periodic structures. Ewald sums
  differ from P3M by P3M's discretisation error (below 1e-2 relative in the
  long-range potentials at metatrain's default ``kspace_resolution``:
  ``tests/model/test_long_range.py``), and cost O(atoms x k-vectors).

:class:`ExportedPET` takes a :class:`petfunc.graph.neighbors.Neighbors` built either way
and rebuilds the long-range inputs for its own method when they differ.

Outputs: ``energy`` [S] (eV), ``energies`` [N] (eV per atom), ``forces`` [N, 3]
(eV/Å), ``strain_derivative`` [S, 3, 3] (dE/d eps in eV; stress = this / volume).

:func:`load` returns an :class:`ExportedPET`, and
:meth:`petfunc.ase.PETCalculator.from_exported` an ASE calculator on top of it. A
library is native code that runs when it is loaded: both load it by default only
from an artifact this machine exported (:mod:`petfunc.export.trust`), any other only
with ``aoti=True``.
"""

from petfunc.export.artifact import ExportedPET as ExportedPET
from petfunc.export.artifact import load as load
from petfunc.export.formats import FORMATS as FORMATS
from petfunc.export.formats import MODEL_SUFFIXES as MODEL_SUFFIXES
from petfunc.export.formats import check_model_file as check_model_file
from petfunc.export.formats import export_model as export_model
from petfunc.export.formats import format_of as format_of
from petfunc.export.inputs import INPUTS as INPUTS
from petfunc.export.inputs import LONG_RANGE_INPUTS as LONG_RANGE_INPUTS
from petfunc.export.inputs import N_GRAPH_FIELDS as N_GRAPH_FIELDS
from petfunc.export.inputs import OUTPUTS as OUTPUTS
from petfunc.export.inputs import input_names as input_names
from petfunc.export.inputs import long_range_inputs as long_range_inputs
from petfunc.export.metatomic import export_metatomic as export_metatomic
from petfunc.export.package import FORMAT as FORMAT
from petfunc.export.package import METADATA as METADATA
from petfunc.export.package import READABLE_VERSIONS as READABLE_VERSIONS
from petfunc.export.package import VERSION as VERSION
from petfunc.export.package import default_aoti as default_aoti
from petfunc.export.package import export as export
from petfunc.export.program import check_dynamic as check_dynamic
from petfunc.export.program import trace as trace
