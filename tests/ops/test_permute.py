"""permute_rows: the same numbers and derivatives (any order, any transform) as a
plain masked gather, with gathers only in its derivatives."""

import pytest
import torch
from torch.func import grad, jacfwd, jacrev, jvp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

from petfunc.ops import dispatch, permute
from tests.helpers.derivative_checks import assert_same_autograd_derivatives


def permute_rows(x, index, inverse, mask=None, inverse_mask=None):
    """The autograd.Function itself (petfunc.ops.permute.permute_rows uses it in traces and
    eager autograd, a plain gather under eager torch.func)."""
    return permute.PermuteRows.apply(x, index, mask, inverse, inverse_mask)


DT = torch.float64


def layout(n=7, pad=4, seed=0):
    """A grid of n real rows (a random permutation of the tokens) and ``pad`` padding rows."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(n, generator=g)
    rows = torch.randperm(n + pad, generator=g)  # where the real rows sit in the grid
    index = torch.zeros(n + pad, dtype=torch.long)
    mask = torch.zeros(n + pad, dtype=torch.bool)
    index[rows[:n]] = perm
    mask[rows[:n]] = True
    inverse = torch.empty(n, dtype=torch.long)
    inverse[perm] = rows[:n]
    return index, mask, inverse


def reference(x, index, mask):
    return torch.where(mask[:, None], x[index], 0.0)


def objective(to_grid):
    weights = torch.randn(11, 3, dtype=DT, generator=torch.Generator().manual_seed(1))

    def f(x):
        y = to_grid(x)
        back = torch.tanh(y)  # and back to the token list, through the inverse map
        return (torch.sin(y) * weights).sum() + (y**3).sum() + (from_grid(back) ** 2 * x).sum()

    return f


INDEX, MASK, INVERSE = layout()


def from_grid(y):
    return permute_rows(y, INVERSE, INDEX, inverse_mask=MASK)


def test_values_and_derivatives_equal_a_plain_gather():
    x = torch.randn(7, 3, dtype=DT)
    v = torch.randn(7, 3, dtype=DT)
    new = objective(lambda x: permute_rows(x, INDEX, INVERSE, mask=MASK))
    ref = objective(lambda x: reference(x, INDEX, MASK))
    assert torch.equal(new(x), ref(x))
    torch.testing.assert_close(grad(new)(x), grad(ref)(x), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(jacfwd(jacrev(new))(x), jacfwd(jacrev(ref))(x), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(jacrev(jacrev(new))(x), jacrev(jacrev(ref))(x), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(
        jvp(grad(new), (x,), (v,))[1], jvp(grad(ref), (x,), (v,))[1], rtol=1e-13, atol=1e-13
    )
    xs = torch.randn(3, 7, 3, dtype=DT)
    torch.testing.assert_close(vmap(grad(new))(xs), vmap(grad(ref))(xs), rtol=1e-14, atol=1e-14)

    # third order: the parameter gradient of a force-like loss
    def loss(f):
        return lambda a: grad(lambda x: f(a * x))(x).pow(2).sum()

    a = torch.tensor(1.3, dtype=DT)
    torch.testing.assert_close(grad(loss(new))(a), grad(loss(ref))(a), rtol=1e-13, atol=1e-13)


def _hvp(permute):
    """A grad of a grad (as in force training: d/da |d f(a x)/dx|^2 . v) of a function
    that goes to the grid and back; ``permute`` is permute_rows or a plain gather."""

    def hvp(x, v, index, mask, inverse):
        def f(x):
            y = permute(x, index, inverse, mask=mask)
            back = permute(torch.tanh(y), inverse, index, inverse_mask=mask)
            return (y**3).sum() + (back**2 * x).sum()

        def loss(x):
            return (grad(f)(x) * v).pow(2).sum()

        return grad(loss)(x)

    return hvp


def plain(x, index, inverse, mask=None, inverse_mask=None):
    y = x[index]
    if mask is not None:
        y = torch.where(mask[:, None], y, 0.0)
    return y


def test_derivatives_trace_to_gathers_only():
    x, v = torch.randn(7, 3, dtype=DT), torch.randn(7, 3, dtype=DT)
    graph = make_fx(_hvp(permute.permute_rows), tracing_mode="symbolic")(x, v, INDEX, MASK, INVERSE)
    scatters = [
        n
        for n in graph.graph.nodes
        if n.op == "call_function" and any(s in str(n.target) for s in ("index_put", "index_add", "scatter"))
    ]
    assert scatters == []
    # the plain gather's derivative is a scatter: the check above can fail
    reference_graph = make_fx(_hvp(plain), tracing_mode="symbolic")(x, v, INDEX, MASK, INVERSE)
    assert any("index_put" in str(n.target) for n in reference_graph.graph.nodes)
    for n, pad, seed in [(7, 4, 0), (5, 9, 3), (12, 1, 4)]:  # one graph, any sizes
        index, mask, inverse = layout(n, pad, seed)
        x, v = torch.randn(n, 3, dtype=DT), torch.randn(n, 3, dtype=DT)
        torch.testing.assert_close(
            graph(x, v, index, mask, inverse), _hvp(plain)(x, v, index, mask, inverse), rtol=1e-13, atol=1e-13
        )


def test_eager_autograd_uses_the_gather_adjoint_torch_func_a_plain_gather(monkeypatch):
    """Eager autograd of a large enough gather goes through the autograd.Function
    (no scatter-add in the backward), with the plain gather's values and first and
    second derivatives; small gathers and eager torch.func transforms keep the plain
    gather (a Function call costs them Python time)."""
    x = torch.randn(7, 3, dtype=DT, requires_grad=True)
    assert "PermuteRows" not in type(permute.permute_rows(x, INDEX, INVERSE, mask=MASK).grad_fn).__name__
    n = dispatch.EAGER_MIN_ELEMENTS // 4
    big, order = torch.randn(n, 4, requires_grad=True), torch.randperm(n)
    assert "PermuteRows" in type(permute.permute_rows(big, order, torch.argsort(order)).grad_fn).__name__
    assert (
        "PermuteRows" not in type(permute.permute_rows(big, order[1:], torch.argsort(order)).grad_fn).__name__
    )
    monkeypatch.setattr(dispatch, "EAGER_MIN_ELEMENTS", 0)
    y = permute.permute_rows(x, INDEX, INVERSE, mask=MASK)
    assert torch.equal(y, reference(x, INDEX, MASK))
    assert "PermuteRows" in type(y.grad_fn).__name__
    new = objective(lambda x: permute.permute_rows(x, INDEX, INVERSE, mask=MASK))
    ref = objective(lambda x: reference(x, INDEX, MASK))
    assert_same_autograd_derivatives(new, ref, x)
    names = []
    grad(
        lambda x: (
            names.append(type(permute.permute_rows(x, INDEX, INVERSE, mask=MASK).grad_fn).__name__) or x.sum()
        )
    )(x.detach())
    assert names and "PermuteRows" not in names[0]


@pytest.mark.parametrize("shape", [(7,), (7, 2, 3)])
def test_rows_of_any_rank(shape):
    x = torch.randn(shape, dtype=DT)
    y = permute_rows(x, INDEX, INVERSE, mask=MASK)
    expected = torch.where(MASK.reshape((-1,) + (1,) * (x.dim() - 1)), x[INDEX], 0.0)
    assert torch.equal(y, expected)
    # adjoint: <P x, g> == <x, P^T g>
    g = torch.randn(y.shape, dtype=DT)
    back = permute_rows(g, INVERSE, INDEX, inverse_mask=MASK)
    torch.testing.assert_close((y * g).sum(), (x * back).sum(), rtol=1e-14, atol=1e-14)
