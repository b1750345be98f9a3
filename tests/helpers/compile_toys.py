"""Toy functions and inputs for the tests of petfunc.compile: a gather, a matmul and a
scatter, as in PET's graph; a momentum training step on a packed (params, moment)
state."""

import torch
from torch.utils import _pytree as pytree

import petfunc


def scatter_energy(params, positions, index):
    """A toy with the ingredients of PET's graph: a gather, a matmul, a scatter."""
    hidden = torch.tanh(positions[index] @ params["w"])
    out = torch.zeros(positions.shape[0], hidden.shape[1], dtype=positions.dtype)
    return out.index_add(0, index, hidden).sum(1)


def example(n_atoms, n_edges, seed=0):
    """``(positions [n_atoms, 3], index [n_edges])``, float64, random."""
    g = torch.Generator().manual_seed(seed)
    positions = torch.randn(n_atoms, 3, generator=g, dtype=torch.float64)
    index = torch.randint(0, n_atoms, (n_edges,), generator=g)
    return positions, index


def accumulate_into_atoms(positions, values, index):
    """Edge values summed into their atoms (an ``index_put`` with accumulation)."""
    return torch.zeros(positions.shape[0], dtype=values.dtype).index_put(
        (index,), values.sin(), accumulate=True
    )


def toy_energy(params, positions, index):
    """The scatter energy of ``params["w"]``, scaled by ``params["v"].sum()``."""
    return scatter_energy({"w": params["w"]}, positions, index).sum() * params["v"].sum()


def momentum_step(state, positions, index):
    """A toy training step on a (params, moment) state: gradient, momentum, update."""
    params, moment = state
    grads, energy = torch.func.grad_and_value(lambda p: toy_energy(p, positions, index))(params)
    new_moment = {k: 0.9 * moment[k] + grads[k] for k in moment}
    new_params = {k: params[k] - 0.1 * new_moment[k] for k in params}
    return (new_params, new_moment), energy


def packed_state(seed=0):
    """A (params, moment) state, each part packed into one buffer (petfunc.tree.pack)."""
    g = torch.Generator().manual_seed(seed)
    params = {
        "w": torch.randn(3, 5, generator=g, dtype=torch.float64),
        "v": torch.randn(4, generator=g, dtype=torch.float64),
    }
    moment = {k: 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype) for k, t in params.items()}
    return (petfunc.tree.pack(params), petfunc.tree.pack(moment))


def clone(state):
    """A copy of every tensor of ``state``."""
    return petfunc.tree.tree_map(lambda t: t.clone(), state)


def assert_state_close(a, b):
    """Every leaf of ``a`` equals that of ``b`` to 1e-12."""
    for x, y in zip(pytree.tree_leaves(a), pytree.tree_leaves(b)):
        torch.testing.assert_close(x, y, rtol=1e-12, atol=1e-12)


def is_packed(leaves) -> bool:
    """Whether ``leaves`` are consecutive views of one buffer (their ravel is a view)."""
    leaves = list(leaves)
    return petfunc.tree.ravel(leaves).data_ptr() == leaves[0].data_ptr() and leaves[0]._base is not None
