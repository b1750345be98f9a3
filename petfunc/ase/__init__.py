"""petfunc.ase."""

from petfunc.ase.calculator import (
    PETCalculator,
    partly_periodic_stress_warning,
)
