"""A tiny PET and options for ``fit`` runs of seconds, and comparisons of their results.

The model (d_pet=8, one GNN layer, cutoff 3 Å: nearest neighbours of fcc) trains on a
few EMT structures (the ``dataset`` fixture of ``tests/trainer/conftest.py``).
"""

import torch

from petfunc import tree


TINY_MODEL = {
    "cutoff": 3.0,
    "cutoff_width": 0.5,
    "d_pet": 8,
    "d_head": 8,
    "d_node": 8,
    "d_feedforward": 8,
    "num_heads": 2,
    "num_attention_layers": 1,
    "num_gnn_layers": 1,
}


def tiny_options(dataset, **training):
    """Options of a tiny model trained on ``dataset`` (2 epochs of batch 4, a quarter for
    validation); ``training`` overrides ``architecture.training`` keys."""
    options = {
        "seed": 3,
        "architecture": {
            "name": "pet",
            "model": dict(TINY_MODEL),
            "training": {"batch_size": 4, "num_epochs": 2, "learning_rate": 1e-2, **training},
        },
        "training_set": str(dataset),
        "validation_set": 0.25,
    }
    return options


def quiet(lines=None):
    """A ``log`` for ``fit`` that keeps the lines in ``lines`` (or drops them)."""
    return (lambda message: lines.append(message)) if lines is not None else (lambda message: None)


def params_equal(a, b):
    """Whether two parameter trees have the same keys and bitwise equal tensors."""
    fa, fb = tree.flatten(a), tree.flatten(b)
    assert fa.keys() == fb.keys()
    return all(torch.equal(fa[k], fb[k]) for k in fa)


def assert_plain(node):
    """Only dicts, lists, tensors and plain scalars (no NamedTuples, no objects)."""
    if isinstance(node, dict):
        for value in node.values():
            assert_plain(value)
    elif isinstance(node, list):
        for value in node:
            assert_plain(value)
    else:
        assert node is None or isinstance(node, (torch.Tensor, str, int, float, bool)), type(node)
