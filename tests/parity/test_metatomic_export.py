"""A model exported as a metatomic model (``petfunc.export.export_metatomic``, what
``petfunc export MODEL -o model.pt`` writes) and run by metatomic's ASE calculator
equals petfunc's calculator on the same weights to 1e-10 relative (float64) in
energy, forces and stress: default, adaptive-cutoff, ZBL, long-range, LoRA-merged
and charge/spin-conditioned models, on a molecule, a periodic cell and a cell
narrower than the cutoff. ``python -m tests.helpers.metatomic_export`` prints the
table."""

import pytest
import torch


pytest.importorskip("metatrain")
pytest.importorskip("metatomic_ase")

from tests.helpers.metatomic_export import KINDS, compare, table


RTOL = 1e-10


@pytest.fixture
def default_dtype():
    """Restores torch's default dtype after a test that changes it."""
    before = torch.get_default_dtype()
    yield torch.set_default_dtype
    torch.set_default_dtype(before)


@pytest.mark.parametrize("kind", KINDS)
def test_metatomic_calculator_equals_petfunc(kind, tmp_path, default_dtype):
    if kind == "ZBL":
        # metatrain's ZBL (and petfunc's, which follows it) computes its screening
        # constants from int32 atomic numbers, in torch's default dtype: float64 here,
        # so that both are float64 throughout (see test_zbl_in_float32_default_dtype)
        default_dtype(torch.float64)
    errors = compare(kind, tmp_path / "model.pt")
    print("\n" + table({(kind, name): e for name, e in errors.items()}))
    for name, quantities in errors.items():
        for quantity, error in quantities.items():
            assert error < RTOL, (kind, name, quantity, error)


def test_zbl_in_float32_default_dtype(tmp_path):
    """With torch's default dtype float32 (what engines run with), the ZBL screening
    constants are float32 in metatrain's ZBL and in petfunc's, and float32 ``pow``
    rounds differently in a vectorised kernel's lanes and its tail, so the two agree
    to ~1e-8 rather than to round-off (petfunc.model.zbl explains)."""
    assert torch.get_default_dtype() == torch.float32
    errors = compare("ZBL", tmp_path / "model.pt")
    print("\n" + table({("ZBL, float32 default dtype", name): e for name, e in errors.items()}))
    for name, quantities in errors.items():
        for quantity, error in quantities.items():
            assert error < 1e-6, (name, quantity, error)
