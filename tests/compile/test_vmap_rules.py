"""petfunc's symbolic-size vmap batching rules (petfunc.compile.symbolic_vmap_rules):
equal to PyTorch's own rules, and scoped: installed inside the ``with`` blocks
(re-entrant), PyTorch's own outside."""

import torch
from torch.func import grad, vmap

from petfunc.compile import symbolic_vmap_rules
from tests.helpers.patches import patch, skip_unless_enabled


def _vmapped(fn, *args, in_dims):
    """(result with our rules, result with PyTorch's)."""
    with symbolic_vmap_rules():
        ours = vmap(fn, in_dims=in_dims)(*args)
    return ours, vmap(fn, in_dims=in_dims)(*args)


def test_rules_equal_pytorch_rules():
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(3, 4, 5, generator=g), torch.randn(4, 2, generator=g)
    c = torch.randn(2, 5, generator=g)
    index = torch.randint(0, 6, (4, 5), generator=g)
    empty = torch.zeros(0)
    cases = [
        # cat: batched + unbatched, negative dim, legacy skip of 1-d empty tensors
        (lambda x, y: torch.cat([x, y], dim=-1), (a, b), (0, None)),
        (lambda x, y: torch.cat([y, x, y], dim=1), (a, b), (0, None)),
        (lambda x: torch.cat([empty, x.reshape(-1)]), (a,), (0,)),
        (lambda x, y: torch.cat([x, y], dim=0), (a.transpose(0, 1), c), (1, None)),
        # scatter_add / gather: every combination of batched self, index, src
        (lambda x: torch.zeros(4, 6).scatter_add(1, index, x), (a,), (0,)),
        (lambda s, x: s.scatter_add(1, index, x), (torch.randn(3, 4, 6, generator=g), a), (0, 0)),
        (
            lambda s, i: s.scatter_add(1, i, a[0]),
            (torch.randn(4, 6), index[None].expand(3, 4, 5) % 6),
            (None, 0),
        ),
        (lambda x: x.gather(1, index), (torch.randn(3, 4, 6, generator=g),), (0,)),
        (lambda i: a[0].gather(1, i), (index[None].expand(3, 4, 5) % 5,), (0,)),
        # slice_backward and the layer-norm pair, through a gradient
        (lambda x: grad(lambda y: (y[:, 1:3] ** 3).sum())(x), (a,), (0,)),
        (
            lambda w: torch.nn.functional.layer_norm(a[0], (5,), w, None),
            (torch.randn(3, 5, generator=g),),
            (0,),
        ),
        (lambda x: grad(lambda y: torch.nn.functional.layer_norm(y, (5,)).pow(3).sum())(x), (a,), (0,)),
        # mm and bmm (torch 2.11's rules call matmul, which reads integer sizes):
        # batched on either side, both, a batch dimension that is not first
        (lambda x: x @ c.t(), (a,), (0,)),
        (lambda w: a[0] @ w, (torch.randn(3, 5, 2, generator=g),), (0,)),
        (lambda x, w: x @ w, (a, torch.randn(5, 2, 3, generator=g)), (0, 2)),
        (lambda x, w: torch.addmm(c[0, :2], x, w), (a, torch.randn(3, 5, 2, generator=g)), (0, 0)),
        (lambda x: torch.bmm(x, a.transpose(1, 2)), (torch.randn(2, 3, 7, 5, generator=g),), (0,)),
        (lambda w: torch.bmm(a, w), (torch.randn(3, 2, 5, 6, generator=g),), (1,)),
        (
            lambda x, w: torch.bmm(x, w),
            (torch.randn(2, 3, 7, 5, generator=g), a.transpose(1, 2)[None].expand(2, 3, 5, 4)),
            (0, 0),
        ),
    ]
    for i, (fn, args, dims) in enumerate(cases):
        ours, theirs = _vmapped(fn, *args, in_dims=dims)
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=f"case {i}")


def test_rules_are_scoped_and_reentrant():
    skip_unless_enabled("vmap_rules")
    skip_unless_enabled("layer_norm_decomposition")
    with symbolic_vmap_rules():
        with symbolic_vmap_rules(decompose_layer_norm=True):
            assert patch("vmap_rules").installed
            assert patch("layer_norm_decomposition").installed
        assert not patch("layer_norm_decomposition").installed
        assert patch("vmap_rules").installed
    assert not patch("vmap_rules").installed
    # PyTorch's own rules are back: nested vmaps of cat still work
    x = torch.randn(2, 3, 4)
    out = vmap(vmap(lambda r: torch.cat([r, r])))(x)
    assert out.shape == (2, 3, 8)
