"""Parameter pytrees: nested dicts (and lists) of tensors with dotted paths.

``flatten(params)`` gives ``{"gnn_layers.0.trans.layers.0.attention.input_linear.weight":
tensor, ...}``: exactly metatrain's state-dict names without the ``backend.`` prefix.
A node whose keys are ``"0", "1", ...`` in order becomes a list on ``unflatten``.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

import torch


Params = Dict[str, Any]


def flatten(tree: Any, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Flat ``{dotted.path: tensor}`` view of a nested dict/list tree (insertion order)."""
    out: Dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def unflatten(flat: Dict[str, torch.Tensor]) -> Params:
    """Inverse of :func:`flatten`."""
    root: dict = {}
    for path, value in flat.items():
        node = root
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return _listify(root)


def _listify(node: Any) -> Any:
    if not isinstance(node, dict):
        return node
    node = {k: _listify(v) for k, v in node.items()}
    if node and list(node) == [str(i) for i in range(len(node))]:
        return list(node.values())
    return node


def tree_map(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """Apply ``fn`` to every leaf, keeping the structure."""
    if isinstance(tree, dict):
        return {k: tree_map(fn, v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(tree_map(fn, v) for v in tree)
    return fn(tree)


def stack(trees) -> Params:
    """Stack several trees of identical structure along a new leading axis (ensembles)."""
    trees = list(trees)
    if not trees:
        raise ValueError("stack() needs at least one parameter tree")
    flats = [flatten(t) for t in trees]
    keys = list(flats[0])
    for i, f in enumerate(flats[1:], start=1):
        if list(f) != keys:
            raise ValueError(f"parameter tree {i} does not have the structure of tree 0")
    return unflatten({k: torch.stack([f[k] for f in flats]) for k in keys})


def unstack(tree: Params):
    """Split a stacked tree (leading ensemble axis) back into a list of trees."""
    flat = flatten(tree)
    n = next(iter(flat.values())).shape[0]
    return [unflatten({k: v[i] for k, v in flat.items()}) for i in range(n)]


def count(tree: Any) -> int:
    """Total number of scalar entries in the tree."""
    return sum(t.numel() for t in flatten(tree).values())
