"""petfunc.ops.bmm: the products of torch.bmm with the same derivatives of every order
and mode, and gradients laid out like the operands they belong to."""

import pytest
import torch
from torch.func import grad, jacfwd, jvp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

from petfunc.ops import bmm


DT = torch.float64
PRODUCTS = {
    "nn": (bmm.BmmNN.apply, lambda a, b: torch.bmm(a, b), ((3, 4, 5), (3, 5, 6))),
    "nt": (bmm.BmmNT.apply, lambda a, b: torch.bmm(a, b.transpose(1, 2)), ((3, 4, 5), (3, 6, 5))),
    "tn": (bmm.BmmTN.apply, lambda a, b: torch.bmm(a.transpose(1, 2), b), ((3, 5, 4), (3, 5, 6))),
}


def operands(shapes, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, dtype=DT, generator=g) for s in shapes]


def objective(product, weights):
    # nonlinear in the product, so that second derivatives involve the product's
    # own derivatives (as force training differentiates attention twice)
    def f(a, b):
        y = product(a, b)
        return (torch.sin(y) * weights).sum() + (y**3).sum()

    return f


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_derivatives_of_every_order_equal_bmm(name):
    new, ref, shapes = PRODUCTS[name]
    a, b = operands(shapes)
    da, db = operands(shapes, seed=1)
    weights = torch.randn(new(a, b).shape, dtype=DT)
    f_new, f_ref = objective(new, weights), objective(ref, weights)
    torch.testing.assert_close(new(a, b), ref(a, b), rtol=0, atol=0)
    for argnums in (0, 1, (0, 1)):
        torch.testing.assert_close(
            grad(f_new, argnums)(a, b), grad(f_ref, argnums)(a, b), rtol=1e-12, atol=1e-12
        )

    # a loss that contains a gradient, differentiated again (force training)
    def second(f):
        return lambda a, b: (grad(f, 0)(a, b) ** 2).sum() + (grad(f, 1)(a, b) * b).sum()

    torch.testing.assert_close(
        grad(second(f_new), (0, 1))(a, b), grad(second(f_ref), (0, 1))(a, b), rtol=1e-12, atol=1e-12
    )
    # forward mode, and forward over reverse (Hessian-vector products)
    torch.testing.assert_close(
        jvp(f_new, (a, b), (da, db)), jvp(f_ref, (a, b), (da, db)), rtol=1e-12, atol=1e-12
    )
    torch.testing.assert_close(
        jvp(grad(f_new, (0, 1)), (a, b), (da, db)),
        jvp(grad(f_ref, (0, 1)), (a, b), (da, db)),
        rtol=1e-12,
        atol=1e-12,
    )
    torch.testing.assert_close(
        jacfwd(grad(f_new, 1), 0)(a, b), jacfwd(grad(f_ref, 1), 0)(a, b), rtol=1e-12, atol=1e-12
    )
    # vmap over an ensemble axis
    stacked = [torch.stack([x, 2 * x]) for x in (a, b)]
    torch.testing.assert_close(
        vmap(grad(f_new, (0, 1)))(*stacked), vmap(grad(f_ref, (0, 1)))(*stacked), rtol=1e-12, atol=1e-12
    )


@pytest.mark.parametrize("name", list(PRODUCTS))
def test_traced_functions_use_the_family(name):
    """While make_fx traces, the public functions are the autograd.Functions: the
    traced gradient has the same numbers as the eager one (a plain bmm)."""
    public = {"nn": bmm.bmm_nn, "nt": bmm.bmm_nt, "tn": bmm.bmm_tn}[name]
    _, ref, shapes = PRODUCTS[name]
    a, b = operands(shapes)
    weights = torch.randn(ref(a, b).shape, dtype=DT)
    f = objective(public, weights)
    traced = make_fx(grad(f, (0, 1)))(a, b)
    torch.testing.assert_close(
        traced(a, b), grad(objective(ref, weights), (0, 1))(a, b), rtol=1e-12, atol=1e-12
    )


def test_key_gradient_is_laid_out_like_the_keys():
    """The point of the family: in q @ k^T the traced gradient of k comes out
    contiguous, where autograd's bmm rule gives a transposed view."""
    q, k = operands(((8, 7, 4), (8, 7, 4)))
    weights = torch.randn(8, 7, 7, dtype=DT)

    def key_gradient(product):
        return make_fx(grad(objective(product, weights), 1))(q, k)(q, k)

    assert key_gradient(bmm.bmm_nt).is_contiguous()
    assert not key_gradient(lambda a, b: torch.bmm(a, b.transpose(1, 2))).is_contiguous()
    torch.testing.assert_close(
        key_gradient(bmm.bmm_nt), key_gradient(lambda a, b: torch.bmm(a, b.transpose(1, 2)))
    )
