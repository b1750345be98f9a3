"""Pytrees: parameter trees with dotted paths, over torch's pytree library.

Two views of one tree. :func:`flatten` gives ``{"gnn_layers.0.trans.layers.0.attention.
input_linear.weight": tensor, ...}``: exactly metatrain's state-dict names without the
``backend.`` prefix (a node whose keys are ``"0", "1", ...`` in order becomes a list
on :func:`unflatten`). :func:`tree_map`, :func:`tree_leaves`, :func:`tree_flatten` and
:func:`tree_unflatten` are ``torch.utils._pytree``'s, for any pytree (dicts, lists,
tuples, NamedTuples such as optimizer states), so that petfunc uses one tree library.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import torch
import torch.utils._pytree as pytree


Params = dict[str, Any]


def flatten(tree: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Flat ``{dotted.path: tensor}`` view of a nested dict/list tree (insertion order)."""
    out: dict[str, torch.Tensor] = {}
    if isinstance(tree, dict):
        items = tree.items()
    elif isinstance(tree, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(tree))
    else:
        return {prefix: tree}
    for key, value in items:
        out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def unflatten(flat: dict[str, torch.Tensor]) -> Params:
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


#: ``fn`` applied to every leaf of one or more pytrees of the same structure
tree_map = pytree.tree_map
#: the leaves of a pytree, in order
tree_leaves = pytree.tree_leaves
#: ``(leaves, spec)`` of a pytree; :func:`tree_unflatten` inverts it
tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten


def stack(trees) -> Any:
    """Stack pytrees of one structure along a new leading axis (ensemble members)."""
    trees = list(trees)
    if not trees:
        raise ValueError("stack() needs at least one parameter tree")
    spec = tree_flatten(trees[0])[1]
    for i, other in enumerate(trees[1:], start=1):
        if tree_flatten(other)[1] != spec:
            raise ValueError(f"parameter tree {i} does not have the structure of tree 0")
    return tree_map(lambda *leaves: torch.stack(leaves), *trees)


def unstack(tree: Any) -> list:
    """The list of trees of a stacked tree (the inverse of :func:`stack`)."""
    n = tree_leaves(tree)[0].shape[0]
    return [tree_map(lambda leaf, i=i: leaf[i], tree) for i in range(n)]


def count(tree: Any) -> int:
    """Total number of scalar entries in the tree."""
    return sum(t.numel() for t in flatten(tree).values())


# ---------------------------------------------------------------------------------------
# packed storage: many leaves as views of one flat buffer
#
# Elementwise work over a whole tree (the optimizer update, gradient clipping) is one
# pass over one vector instead of one kernel per leaf when the leaves share a buffer.
# Compiled, this is a few fused kernels instead of a few per leaf, which took 40 % of
# the training step's compile time. The layout is only ever an optimisation: every
# function below gives the same values for leaves in separate tensors.


def packed_range(leaves):
    """``(buffer, start, stop)`` when ``leaves`` are contiguous views of one contiguous
    buffer, consecutive in this order (element offsets), else ``None``."""
    base = getattr(leaves[0], "_base", None)
    # a traced base of symbolic size (views of data-sized intermediates) has symbolic
    # offsets, which cannot be compared here
    if base is None or any(type(n) is not int for n in base.shape) or not base.is_contiguous():
        return None
    try:
        origin = base.storage_offset()
        offset = start = leaves[0].storage_offset() - origin
        for leaf in leaves:
            if leaf._base is not base or not leaf.is_contiguous():
                return None
            here = leaf.storage_offset() - origin
            # symbolic offsets (traced views of data-sized tensors): not comparable
            if type(here) is not int or here != offset:
                return None
            offset += leaf.numel()
    except (RuntimeError, NotImplementedError):  # tensors without storage (vmap, ...)
        return None
    return base, start, offset


def ravel(leaves) -> torch.Tensor:
    """The leaves flattened and concatenated into one 1-d tensor.

    No copy when they already are consecutive views of one buffer (see :func:`pack`):
    the result is then a view of that buffer. All leaves must share dtype and device.
    """
    leaves = list(leaves)
    packed = packed_range(leaves) if leaves else None
    if packed is not None:
        base, start, stop = packed
        return base.view(-1)[start:stop]
    return torch.cat([leaf.reshape(-1) for leaf in leaves])


def unravel(flat: torch.Tensor, shapes) -> list:
    """Views of consecutive pieces of the 1-d ``flat``, one per shape (inverse of
    :func:`ravel`)."""
    shapes = [tuple(s) for s in shapes]
    sizes = [math.prod(s) for s in shapes]
    return [piece.view(shape) for piece, shape in zip(torch.split(flat, sizes), shapes)]


def pack(tree: Any) -> Any:
    """A copy of ``tree`` whose tensor leaves are views of one flat buffer per
    (dtype, device), in leaf order (0-d leaves too).

    Works on any pytree (dicts, lists, NamedTuples). Values are unchanged; only the
    memory layout differs, which lets :func:`ravel` return the buffer without a copy.
    """
    leaves, spec = tree_flatten(tree)
    groups: dict[Any, list] = {}
    for index, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            groups.setdefault((leaf.dtype, leaf.device), []).append(index)
    out = list(leaves)
    for indices in groups.values():
        members = [leaves[i].detach() for i in indices]
        flat = torch.cat([m.reshape(-1) for m in members])
        for i, view in zip(indices, unravel(flat, [m.shape for m in members])):
            out[i] = view
    return tree_unflatten(out, spec)


def differences(before: Mapping, after: Mapping, prefix: str = "") -> list[str]:
    """``"path: old -> new"`` (values as JSON) for each leaf whose value differs
    between two nested mappings (two runs' resolved options, say); a key present in
    one only differs from ``null``."""
    changed = []
    for key in list(before) + [k for k in after if k not in before]:
        path = f"{prefix}{key}"
        old, new = before.get(key), after.get(key)
        if isinstance(old, Mapping) and isinstance(new, Mapping):
            changed += differences(old, new, path + ".")
        elif old != new:
            changed.append(f"{path}: {json.dumps(old)} -> {json.dumps(new)}")
    return changed
