"""ASE: :class:`PETCalculator` (one structure at a time) and :class:`BatchEvaluator`
(many structures in one model call, for batched relaxation and dynamics)."""

from petfunc.ase.batch import BatchEvaluator as BatchEvaluator
from petfunc.ase.calculator import PETCalculator as PETCalculator
from petfunc.ase.results import partly_periodic_stress_warning as partly_periodic_stress_warning
from petfunc.ase.results import voigt as voigt
