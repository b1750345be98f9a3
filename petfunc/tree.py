"""Pytrees: parameter trees with dotted paths, over torch's pytree library.

Two views of one tree. :func:`flatten` gives ``{"gnn_layers.0.trans.layers.0.attention.
input_linear.weight": tensor, ...}``: exactly metatrain's state-dict names without the
``backend.`` prefix (a node whose keys are ``"0", "1", ...`` in order becomes a list
on :func:`unflatten`). :func:`tree_leaves`, :func:`tree_flatten` and
:func:`tree_unflatten` are ``torch.utils._pytree``'s, for any pytree (dicts, lists,
tuples, NamedTuples such as optimizer states), so that petfunc uses one tree library;
:func:`tree_map` is its ``tree_map`` with errors that name the first differing key.

Tree algebra, as JAX and optax have it: :func:`ravel_pytree` (``jax.flatten_util``'s:
one flat vector and the function that rebuilds the tree), :func:`tree_vdot`,
:func:`tree_add`, :func:`tree_scale`; :func:`map_with_path` calls a function with each
leaf's dotted path (the keys of :func:`flatten`); :func:`check_structure` names where
two trees differ.
"""

from __future__ import annotations

import functools
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


#: the leaves of a pytree, in order
tree_leaves = pytree.tree_leaves
#: ``(leaves, spec)`` of a pytree; :func:`tree_unflatten` inverts it
tree_flatten = pytree.tree_flatten
tree_unflatten = pytree.tree_unflatten


def key_name(entry) -> str:
    """The dotted-path part of one ``torch.utils._pytree`` key entry: a dict key, a
    list or tuple index, a NamedTuple field."""
    for attribute in ("key", "idx", "name"):
        if hasattr(entry, attribute):
            return str(getattr(entry, attribute))
    return str(entry)


def dotted(key_path) -> str:
    """The dotted path (``"gnn_layers.0.weight"``, as :func:`flatten` names leaves) of a
    ``torch.utils._pytree`` key path."""
    return ".".join(key_name(entry) for entry in key_path)


def map_with_path(fn, tree: Any, *rest, is_leaf=None) -> Any:
    """``fn(path, leaf, *other_leaves)`` on every leaf, ``path`` its dotted path (the
    keys of :func:`flatten`: ``"gnn_layers.0.trans.layers.0.norm_attention.weight"``)."""
    return pytree.tree_map_with_path(
        lambda path, *leaves: fn(dotted(path), *leaves), tree, *rest, is_leaf=is_leaf
    )


def _children(node, is_leaf):
    """``None`` for a leaf, else ``[(key, child), ...]`` one level down."""
    if pytree.tree_structure(node, is_leaf=is_leaf).is_leaf():
        return None
    items, _ = pytree.tree_flatten_with_path(node, is_leaf=lambda x: x is not node)
    return [(key_name(path[0]), child) for path, child in items]


def _describe(node, children) -> str:
    if children is None:
        return "None" if node is None else f"a leaf ({type(node).__name__})"
    return f"a {type(node).__name__} of {len(children)}"


def structure_difference(first, second, names=("the first", "the second"), is_leaf=None, prefix=False):
    """Where two pytrees first differ in structure, in words (``"trees differ at
    'gnn_layers.0.weight': missing in the second"``), or ``None`` when they have one
    structure (dicts whose keys come in another order match). ``names`` name the two
    trees; with ``prefix``, a leaf of ``first`` matches any subtree of ``second``
    (``tree_map``'s rule)."""
    return _difference(first, second, "", names, is_leaf, prefix)


def _difference(a, b, path, names, is_leaf, prefix):
    first, second = _children(a, is_leaf), _children(b, is_leaf)
    if first is None and (second is None or prefix):
        return None
    where = f"'{path}'" if path else "the root"
    if first is None or second is None or type(a) is not type(b):
        return (
            f"trees differ at {where}: {_describe(a, first)} in {names[0]}, "
            f"{_describe(b, second)} in {names[1]}"
        )
    keys_a, keys_b = [k for k, _ in first], [k for k, _ in second]
    for keys, others, name in ((keys_a, keys_b, names[1]), (keys_b, keys_a, names[0])):
        for key in keys:
            if key not in others:
                return f"trees differ at '{path + '.' if path else ''}{key}': missing in {name}"
    # children paired by key: dicts whose keys come in another order match, as
    # torch's tree_map matches them
    by_key = dict(second)
    for key, child_a in first:
        found = _difference(child_a, by_key[key], f"{path}.{key}" if path else key, names, is_leaf, prefix)
        if found is not None:
            return found
    return None


def _ordinal(i: int) -> str:
    return ("the first", "the second", "the third")[i] if i < 3 else f"tree {i}"


def check_structure(tree: Any, *rest, is_leaf=None, prefix: bool = False) -> None:
    """Raise ``ValueError`` naming the first differing key (:func:`structure_difference`)
    unless every tree of ``rest`` has the structure of ``tree`` (with ``prefix``: has
    ``tree`` as a prefix)."""
    for i, other in enumerate(rest, start=1):
        difference = structure_difference(tree, other, (_ordinal(0), _ordinal(i)), is_leaf, prefix)
        if difference is not None:
            raise ValueError(difference)


def tree_map(fn, tree: Any, *rest, is_leaf=None) -> Any:
    """``fn(leaf, *other_leaves)`` on every leaf of ``tree`` and the leaves in the same
    place of each tree of ``rest``, rebuilt in ``tree``'s structure (NamedTuples stay
    NamedTuples). ``tree`` may be a prefix of the others (its leaf then meets their
    subtree), as in ``torch.utils._pytree`` and JAX. Trees of another structure raise
    ``ValueError`` naming the first differing key."""
    if not rest:
        return pytree.tree_map(fn, tree, is_leaf=is_leaf)
    leaves, spec = pytree.tree_flatten(tree, is_leaf=is_leaf)
    others = [pytree.tree_flatten(other, is_leaf=is_leaf) for other in rest]
    if all(other_spec == spec for _, other_spec in others):
        return pytree.tree_unflatten([fn(*xs) for xs in zip(leaves, *(ls for ls, _ in others))], spec)
    check_structure(tree, *rest, is_leaf=is_leaf, prefix=True)
    return pytree.tree_map(fn, tree, *rest, is_leaf=is_leaf)


def ravel_pytree(tree: Any):
    """``(flat, unravel)``: every tensor leaf flattened and concatenated in leaf order
    into one 1-d tensor, and the function that rebuilds the tree from such a vector,
    as ``jax.flatten_util.ravel_pytree``.

    Leaves of several dtypes are promoted to one (``torch.promote_types``: int64 with
    float32 gives float32, float32 with float64 float64); ``unravel`` casts each piece
    back to its leaf's dtype and shape. ``flat`` is always a new tensor. Leaves must be
    tensors on one device. Works under ``torch.func`` transforms (``flat`` of a
    vmapped tree is vmapped). ``unravel(v)`` needs a 1-d ``v`` of ``flat``'s size.
    """
    leaves, spec = pytree.tree_flatten(tree)
    paths = [dotted(p) for p, _ in pytree.tree_flatten_with_path(tree)[0]]
    for path, leaf in zip(paths, leaves):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(f"ravel_pytree: the leaf at '{path}' is a {type(leaf).__name__}, not a tensor")
    devices = {leaf.device for leaf in leaves}
    if len(devices) > 1:
        raise ValueError(
            f"ravel_pytree: the leaves are on several devices ({sorted(map(str, devices))}): move them to one"
        )
    dtypes = [leaf.dtype for leaf in leaves]
    shapes = [leaf.shape for leaf in leaves]
    dtype = functools.reduce(torch.promote_types, dtypes) if leaves else torch.get_default_dtype()
    if leaves:
        flat = torch.cat([leaf.reshape(-1).to(dtype) for leaf in leaves])
    else:
        flat = torch.zeros(0, dtype=dtype)
    size = flat.shape[0]

    def unravel(vector: torch.Tensor):
        if vector.dim() != 1 or vector.shape[0] != size:
            raise ValueError(
                f"unravel: expected a 1-d tensor of {size} entries (the raveled tree's), "
                f"got shape {tuple(vector.shape)}"
            )
        pieces = torch.split(vector, [math.prod(s) for s in shapes]) if shapes else []
        out = [piece.reshape(shape).to(d) for piece, shape, d in zip(pieces, shapes, dtypes)]
        return pytree.tree_unflatten(out, spec)

    return flat, unravel


def tree_vdot(tree_x: Any, tree_y: Any) -> torch.Tensor:
    """``sum over leaves of sum(conj(x) * y)``: the inner product of two trees of one
    structure as vectors (optax's ``tree_vdot``), a 0-d tensor."""
    check_structure(tree_x, tree_y)
    products = tree_leaves(pytree.tree_map(lambda x, y: (x.conj() * y).sum(), tree_x, tree_y))
    return functools.reduce(torch.add, products) if products else torch.zeros(())


def tree_add(tree_x: Any, tree_y: Any, *trees) -> Any:
    """The leafwise sum of two or more trees of one structure (optax's ``tree_add``)."""
    check_structure(tree_x, tree_y, *trees)
    return pytree.tree_map(lambda *leaves: functools.reduce(torch.add, leaves), tree_x, tree_y, *trees)


def tree_scale(scalar, tree: Any) -> Any:
    """Every leaf multiplied by ``scalar`` (a number or 0-d tensor; optax's ``tree_scale``)."""
    return pytree.tree_map(lambda leaf: scalar * leaf, tree)


def stack(trees) -> Any:
    """Stack pytrees of one structure along a new leading axis (ensemble members)."""
    trees = list(trees)
    if not trees:
        raise ValueError("stack() needs at least one parameter tree")
    for i, other in enumerate(trees[1:], start=1):
        difference = structure_difference(trees[0], other, names=("tree 0", f"tree {i}"))
        if difference is not None:
            raise ValueError(f"parameter tree {i} does not have the structure of tree 0: {difference}")
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
