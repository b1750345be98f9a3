"""ASE: :class:`PETCalculator` (one structure at a time) and :class:`BatchEvaluator`
(many structures in one model call, for batched relaxation and dynamics)::

    from petfunc.ase import PETCalculator
    atoms.calc = PETCalculator.from_checkpoint("model.pt", compile=True)

Conventions, as in metatomic's ASE calculator (``metatomic_ase.MetatomicCalculator``)
for the same model:

* ``stress = (1/V) dE/d eps`` in eV/Å^3 with V = ``atoms.cell.volume``, returned in
  ASE's Voigt order (xx, yy, zz, yz, xz, xy) with the off-diagonal pairs averaged
  ((s_ab + s_ba)/2: PET's strain derivative is not exactly symmetric);
* a cell with zero volume (a molecule) has no stress: asking for it raises
  :class:`~ase.calculators.calculator.PropertyNotImplementedError` (metatomic
  returns ``inf`` there); a partly periodic structure whose ASE cell has a volume
  gets metatomic's number, with the same warning;
* ``energies`` are per-atom energies, summing to ``energy`` (every calculation
  stores them);
* the model sees each structure moved, in float64, close to the origin (a
  molecule centred, a crystal by lattice vectors; a float32 model also gets every
  atom wrapped into the cell along its periodic directions): the results are those
  of the structure as given, whose ``Atoms`` are not modified, and a structure far
  from the origin costs the float32 edge vectors no digits;
* a model with ``system_conditioning`` reads the total charge from
  ``atoms.info["charge"]`` and the spin multiplicity 2S+1 from
  ``atoms.info["spin_multiplicity"]`` (or ``atoms.info["spin"]``, OMol25's name),
  0 and 1 when absent; changing them invalidates the results.

With ``ensemble_params`` (a parameter tree whose leaves have a leading committee
axis, see :func:`petfunc.tree.stack`), every calculation also evaluates the
committee and gives ``energy_uncertainty``, ``forces_uncertainty`` and, for
periodic cells, ``stress_uncertainty``: the standard deviation over members
(``ddof=0``), component by component. The members' values are in
``energy_ensemble``, ``forces_ensemble``. The eager path evaluates the committee with
``torch.func.vmap``; the compiled path loops over members with the single compiled
function (inductor miscompiles some vmapped scatter/index ops on CPU,
pytorch/pytorch#183986).
"""

from petfunc.ase.batch import BatchEvaluator as BatchEvaluator
from petfunc.ase.calculator import PETCalculator as PETCalculator
from petfunc.ase.results import partly_periodic_stress_warning as partly_periodic_stress_warning
from petfunc.ase.results import voigt as voigt
