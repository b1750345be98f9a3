"""petfunc's patches of torch internals, by name, for tests (through the public
accessor patches() of petfunc.compile)."""

import pytest

from petfunc.compile import patches


def patch(name: str):
    """The patch ``name`` of ``patches()`` of :mod:`petfunc.compile`."""
    return next(p for p in patches() if p.name == name)


def skip_unless_enabled(name: str) -> None:
    """Skip the calling test where the patch ``name`` is off (``PETFUNC_STOCK_TORCH``,
    ``PETFUNC_PATCHES_OFF``, or not needed on this torch): it tests that patch."""
    if not patch(name).allowed():
        pytest.skip(f"petfunc's patch {name} of torch internals is off")


def needs_patches(*names: str):
    """Mark a test of a computation that needs these correctness patches where this
    torch needs them: with one of them switched off (``PETFUNC_STOCK_TORCH=1``,
    ``PETFUNC_PATCHES_OFF``) the computation raises ``PatchUnavailableError`` by
    design (tests/compile/test_patches.py checks that), and the test is skipped."""
    off = [name for name in names if patch(name).needed and not patch(name).allowed()]
    return pytest.mark.skipif(bool(off), reason=f"needs petfunc's patches {', '.join(off)}, switched off")
