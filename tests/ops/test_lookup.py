"""lookup_rows: the numbers and derivatives (any order, any transform) of a plain
row gather, with a matrix product, not a scatter, as the table's adjoint."""

import torch
from torch.func import grad, jacfwd, jacrev, jvp, vmap
from torch.fx.experimental.proxy_tensor import make_fx

from petfunc.ops import dispatch, lookup
from tests.helpers.derivative_checks import assert_same_autograd_derivatives


DT = torch.float64
INDEX = torch.tensor([2, 0, 2, 2, 1, 0, 2, 3, 2])  # repeated rows, as species are


def lookup_rows(table, index):
    """The autograd.Function itself (lookup.lookup_rows uses it in traces and eager
    autograd, a plain gather under eager torch.func)."""
    return lookup.LookupRows.apply(table, index)


def objective(gather):
    weights = torch.randn(9, 3, dtype=DT, generator=torch.Generator().manual_seed(1))

    def f(table):
        y = gather(table, INDEX)
        return (torch.sin(y) * weights).sum() + (y**3).sum() + (y.sum(0) ** 2 * table[1]).sum()

    return f


def plain(table, index):
    return table[index]


def test_values_and_derivatives_equal_a_plain_gather():
    table = torch.randn(4, 3, dtype=DT)
    v = torch.randn(4, 3, dtype=DT)
    new, ref = objective(lookup_rows), objective(plain)
    assert torch.equal(new(table), ref(table))
    torch.testing.assert_close(grad(new)(table), grad(ref)(table), rtol=1e-14, atol=1e-14)
    torch.testing.assert_close(jacrev(jacrev(new))(table), jacrev(jacrev(ref))(table), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(jacfwd(jacrev(new))(table), jacfwd(jacrev(ref))(table), rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(
        jvp(grad(new), (table,), (v,))[1], jvp(grad(ref), (table,), (v,))[1], rtol=1e-13, atol=1e-13
    )
    tables = torch.randn(3, 4, 3, dtype=DT)  # an ensemble of tables
    torch.testing.assert_close(vmap(grad(new))(tables), vmap(grad(ref))(tables), rtol=1e-14, atol=1e-14)


def _force_loss_gradient(gather):
    """The parameter gradient of a force-like loss, as in training: positions ``x``
    mix with looked-up rows, d/dtable |d E / dx|^2."""

    def energy(table, x, index):
        rows = gather(table, index)  # [n, 3]
        return (torch.tanh(rows * x) ** 2).sum() + (rows.sum(0) * x.sum(0)).sum()

    def loss(table, x, index):
        return grad(energy, argnums=1)(table, x, index).pow(2).sum()

    return grad(loss)


def test_traced_training_gradient_has_no_scatter_and_any_size():
    table, x = torch.randn(4, 3, dtype=DT), torch.randn(9, 3, dtype=DT)
    graph = make_fx(_force_loss_gradient(lookup.lookup_rows), tracing_mode="symbolic")(table, x, INDEX)
    targets = [str(n.target) for n in graph.graph.nodes if n.op == "call_function"]
    assert not [t for t in targets if any(s in t for s in ("index_put", "index_add", "scatter"))]
    assert any("mm" in t for t in targets)
    # the plain gather's adjoint is a scatter: the check above can fail
    reference = make_fx(_force_loss_gradient(plain), tracing_mode="symbolic")(table, x, INDEX)
    assert any("index_put" in str(n.target) for n in reference.graph.nodes)
    g = torch.Generator().manual_seed(2)
    for n in (9, 1, 30):  # one graph, any number of rows
        index = torch.randint(0, 4, (n,), generator=g)
        x = torch.randn(n, 3, dtype=DT, generator=g)
        torch.testing.assert_close(
            graph(table, x, index), _force_loss_gradient(plain)(table, x, index), rtol=1e-13, atol=1e-13
        )


def test_eager_autograd_uses_the_product_adjoint_torch_func_and_large_tables_a_gather(monkeypatch):
    """Eager autograd of a large enough lookup goes through the autograd.Function
    (its first and second derivatives those of the plain gather); small lookups and
    eager torch.func keep the plain gather, and tables of more than MAX_ROWS rows
    keep the gather's adjoint everywhere."""
    table = torch.randn(4, 3, dtype=DT, requires_grad=True)
    assert "LookupRows" not in type(lookup.lookup_rows(table, INDEX).grad_fn).__name__
    many = torch.randint(0, 4, (-(-dispatch.EAGER_MIN_ELEMENTS // 3),))  # 3 columns
    assert "LookupRows" in type(lookup.lookup_rows(table, many).grad_fn).__name__
    assert "LookupRows" not in type(lookup.lookup_rows(table, many[1:]).grad_fn).__name__
    monkeypatch.setattr(dispatch, "EAGER_MIN_ELEMENTS", 0)
    y = lookup.lookup_rows(table, INDEX)
    assert torch.equal(y, table[INDEX]) and "LookupRows" in type(y.grad_fn).__name__
    new, ref = objective(lookup.lookup_rows), objective(plain)
    assert_same_autograd_derivatives(new, ref, table)
    names = []
    grad(lambda t: names.append(type(lookup.lookup_rows(t, INDEX).grad_fn).__name__) or t.sum())(
        table.detach()
    )
    assert names and "LookupRows" not in names[0]
    big = torch.randn(lookup.MAX_ROWS + 1, 3, dtype=DT, requires_grad=True)
    assert "LookupRows" not in type(lookup.lookup_rows(big, INDEX).grad_fn).__name__

    def traced_ops(n_rows):
        big = torch.randn(n_rows, 3, dtype=DT)
        f = grad(lambda t: lookup.lookup_rows(t, INDEX).pow(2).sum())
        return [str(n.target) for n in make_fx(f)(big).graph.nodes if n.op == "call_function"]

    assert not any("index_put" in t for t in traced_ops(lookup.MAX_ROWS))
    assert any("index_put" in t for t in traced_ops(lookup.MAX_ROWS + 1))
