"""Shared pieces of the researcher's-toolkit tests: a small config, the toy energy's
parameters and batches, a loss of one's own, and a hand-written SGD optimizer."""

import torch

import petfunc
from tests.helpers import toy


F64 = torch.float64
#: four species (H, C, N, O), as the toy energy's embedding
CONFIG = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8), d_pet=4, d_node=4, d_head=4, d_feedforward=4, num_heads=1
)


def toy_params(seed: int = 0):
    """The toy energy's parameters (nested dicts, composition and scale included)."""
    return toy.init(seed=seed)


def toy_batch(n: int = 3, seed: int = 0):
    """A padded batch of ``n`` EMT-labelled structures for the toy energy."""
    return toy.labelled_batch(CONFIG, n, seed=seed)


def energy_loss(params, batch):
    """A loss of one's own: the squared error of the toy energy per structure."""
    energies = toy.energy(params, batch.positions, batch.cell, batch.neighbors)
    loss = ((energies - batch.energy) ** 2).mean()
    return loss, {"loss": loss, "mean_energy": energies.mean()}


class SGD:
    """Plain SGD written by hand, with only ``init`` and ``update(grads, state)`` (no
    ``params`` or ``inplace`` arguments): an optax-like ``GradientTransformation``."""

    def __init__(self, learning_rate: float):
        self.learning_rate = learning_rate

    def init(self, params):
        return {"steps": torch.zeros((), dtype=torch.int64)}

    def update(self, grads, state):
        updates = petfunc.tree.tree_map(lambda g: -self.learning_rate * g, grads)
        return updates, {"steps": state["steps"] + 1}
