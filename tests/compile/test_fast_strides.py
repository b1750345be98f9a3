"""The fast_strides patch (patches() of petfunc.compile): inductor's vectorization
strides without sympy.simplify.

The fast path must give the stride inductor's own analysis gives: the same number
where that is a number (0 broadcast, 1 contiguous, else a constant stride) and an
equal expression where it is symbolic; indices that are not polynomials must go to
inductor's functions untouched."""

import random

import pytest
import sympy
from torch.utils._sympy.functions import FloorDiv, ModularIndexing

from tests.helpers.patches import patch, skip_unless_enabled


# torch._inductor.sizevars (2.13) or torch._inductor.codegen.cpp (2.11)
FAST_STRIDES = patch("fast_strides")
strides = FAST_STRIDES.module
sizevars = strides.analysis_module()
if sizevars is None:
    pytest.skip("this torch has no such stride analysis", allow_module_level=True)

x0, x1, x2, x3, d0, d1, d2, d3 = sympy.symbols("x0 x1 x2 x3 d0 d1 d2 d3", integer=True, nonnegative=True)
s53, s70, ks1, ks2 = sympy.symbols("s53 s70 ks1 ks2", integer=True, positive=True)
tmp5 = sympy.Symbol("tmp5", integer=True)

# indices of PET's carbon training step, as inductor's C++ code generation saw them
PET_INDICES = [
    (384 * d0 * s53 + 384 * d0 + 16 * d1 * s53 + 16 * d1 + d2 * s53 + d2 + d3, d3),
    (384 * d0 * s53 + 384 * d0 + 16 * d1 * s53 + 16 * d1 + d2 * s53 + d2 + d3, d1),
    (8 * d0 * s53**2 + 16 * d0 * s53 + 8 * d0 + d1 * s53**2 + 2 * d1 * s53 + d1 + d2 + d3 * s53 + d3, d0),
    (8 * d0 * s53**2 + 16 * d0 * s53 + 8 * d0 + d1 * s53**2 + 2 * d1 * s53 + d1 + d2 + d3 * s53 + d3, d3),
    (128 * ks1 * x0 + 16 * ks1 * x1 + ks1 * x2 + 128 * x0 + 16 * x1 + x2 + x3, x2),
    (d0 * s53 + d0, d0),
    (s70 * d0, d1),
    (x0 * x1 + 3, x1),
]
NON_POLYNOMIAL = [
    (
        16 * ks2 * x1
        + 128 * ks2 * ModularIndexing(tmp5, ks2 + 1, ks1)
        + x1
        + 16 * ModularIndexing(tmp5, 1, ks2 + 1),
        x1,
    ),
    (FloorDiv(x0, 16) * s53 + x0, x0),
    (ModularIndexing(x1, 1, 32) + 4 * x0, x1),
    (FloorDiv(x0 + 3, 2) + x0, x0),
]


def _reference(index, var, vec_length):
    """inductor's own answer, bypassing its cache."""
    return sizevars.stride_at_vec_range.__wrapped__(index, var, vec_length)


def _fast(index, var, vec_length):
    with FAST_STRIDES.scope():
        return sizevars.stride_at_vec_range.__wrapped__(index, var, vec_length)


def _random_polynomial(rng):
    symbols = [x0, x1, x2, d0, d1, s53, s70, ks1]
    terms = []
    for _ in range(rng.randint(1, 7)):
        term = sympy.Integer(rng.choice([1, 2, 3, 16, 128, 384, -1]))
        for _ in range(rng.randint(0, 3)):
            term *= rng.choice(symbols) ** rng.randint(1, 2)
        terms.append(term)
    expression = sympy.Add(*terms)
    if rng.random() < 0.5:  # a factored form, as index arithmetic builds some
        expression = sympy.Mul(rng.choice(symbols) + rng.randint(0, 3), expression, evaluate=False)
    return expression, rng.choice(symbols[:5])


def _same(a, b):
    assert a.is_number == b.is_number, (a, b)
    assert sympy.simplify(a - b) == 0, (a, b)


@pytest.mark.parametrize("index,var", PET_INDICES)
def test_polynomial_indices_give_inductors_stride(index, var):
    assert strides.is_polynomial(index)
    for vec_length in (8, 16):
        _same(_fast(index, var, vec_length), _reference(index, var, vec_length))


def test_random_polynomials_give_inductors_stride():
    rng = random.Random(7)
    numbers = 0
    for _ in range(60):
        index, var = _random_polynomial(rng)
        fast, reference = _fast(index, var, 16), _reference(index, var, 16)
        _same(fast, reference)
        numbers += reference.is_number
    assert 0 < numbers < 60  # both kinds of stride were checked


@pytest.mark.parametrize("index,var", NON_POLYNOMIAL)
def test_other_indices_go_to_inductor(index, var):
    assert not strides.is_polynomial(index)
    assert _fast(index, var, 16) == _reference(index, var, 16)


def test_the_patch_is_scoped(monkeypatch):
    skip_unless_enabled("fast_strides")
    originals = sizevars.stride_at, sizevars.simplify_index_in_vec_range
    with FAST_STRIDES.scope():
        assert sizevars.stride_at is not originals[0]
        with FAST_STRIDES.scope():  # re-entrant
            pass
        assert sizevars.simplify_index_in_vec_range is not originals[1]
    assert (sizevars.stride_at, sizevars.simplify_index_in_vec_range) == originals
    monkeypatch.setenv("PETFUNC_FAST_STRIDES", "0")
    with FAST_STRIDES.scope():
        assert (sizevars.stride_at, sizevars.simplify_index_in_vec_range) == originals
