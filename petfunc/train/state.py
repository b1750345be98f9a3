"""The training state: parameters and optimizer state, and which parameters train.

Composition weights and the energy scale (:data:`FROZEN`) are fitted, not trained:
they stay out of the gradient and the optimizer. ``train=`` (path prefixes, see
:func:`trainable`) restricts training to part of the weights, for fine-tuning.

The trained parameters and each part of the optimizer state shaped like them are
kept packed, as views of one buffer each (:func:`pack_state`): clipping, the Adam
update and adding the update then work on whole vectors without copies (see
:func:`petfunc.tree.pack`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from petfunc import tree


FROZEN = ("composition_weights", "energy_scale")


class TrainState(NamedTuple):
    """Parameters (including the frozen composition and scale) and optimizer state."""

    params: Any
    opt_state: Any


# metatrain's default selection for ``finetune: {method: heads}``
HEADS = ("node_heads", "edge_heads", "node_last_layers", "edge_last_layers")


#: which parameters train: ``None`` (all but :data:`FROZEN`), dotted-path prefixes, or
#: a predicate ``(path, leaf) -> bool``
Train = Sequence[str] | Callable[[str, Any], bool] | None


def trainable(params, train: Train = None):
    """The trained part of a PET parameter tree.

    ``train=None``: everything but the composition weights and the energy scale, as a
    tree of the same nesting. ``train``: a sequence of dotted-path prefixes (for
    example :data:`HEADS`, metatrain's ``finetune: {method: heads}``) or a predicate
    ``train(path, leaf) -> bool`` of the dotted path (:func:`petfunc.tree.flatten`'s
    keys) and the tensor; the trained part is then a flat ``{dotted.path: tensor}``
    dict of the parameters whose path starts with one of the prefixes (string
    prefixes, as metatrain matches module names) or that the predicate selects, and
    everything else is held fixed. :data:`FROZEN` never trains. Raises ``ValueError``
    when nothing matches.
    """
    if train is None:
        return {k: v for k, v in params.items() if k not in FROZEN}
    selected = {path: value for path, value in tree.flatten(params).items() if _selects(train, path, value)}
    if not selected:
        top = sorted({p.split(".")[0] for p in tree.flatten(params)} - set(FROZEN))
        what = (
            f"train={train!r} selects no parameter"
            if callable(train)
            else (f"no parameter path starts with any of {list(train)}")
        )
        raise ValueError(f"{what}; the parameters are under {top}")
    return selected


def _selects(train: Train, path: str, leaf) -> bool:
    """Whether ``train`` (see :func:`trainable`) trains the leaf at ``path``."""
    if path.split(".")[0] in FROZEN:
        return False
    if train is None:
        return True
    if callable(train):
        return bool(train(path, leaf))
    if isinstance(train, str):
        raise TypeError(
            "train must be a sequence of path prefixes or a predicate (path, leaf) -> bool, not one string"
        )
    return any(path.startswith(prefix) for prefix in train)


def partition(params, train: Train = None):
    """``(trained, frozen)``: a parameter tree split in two, equinox style, so that a
    function of the trained part alone can be differentiated, vmapped or optimized.

    ``trained`` is the flat ``{dotted.path: tensor}`` dict of the parameters ``train``
    selects (as :func:`trainable` with prefixes or a predicate; ``train=None``:
    all but :data:`FROZEN`, the composition weights and energy scale, which metatrain
    fits on the data), in leaf order: only tensors, so ``torch.func.grad`` and
    ``vmap`` take it as it is. ``frozen`` is ``params`` with ``None`` in place of each
    trained leaf. :func:`combine` joins them: ``combine(*partition(params, train))``
    is ``params`` with the same tensors. ``params`` must have no ``None`` leaf.

    Example (fine-tuning the heads with any loss)::

        trained, frozen = petfunc.partition(params, petfunc.train.HEADS)
        grads = torch.func.grad(lambda t: loss(petfunc.combine(t, frozen), batch))(trained)
    """
    flat = tree.flatten(params)
    for path, leaf in flat.items():
        if leaf is None:
            raise ValueError(
                f"partition: the parameter tree has None at '{path}', which frozen trees use as a hole"
            )
    trained = (
        trainable(params, train)
        if train is not None
        else {path: leaf for path, leaf in flat.items() if _selects(None, path, leaf)}
    )
    frozen = tree.map_with_path(lambda path, leaf: None if path in trained else leaf, params)
    return dict(trained), frozen


def combine(trained, frozen):
    """The parameter tree of :func:`partition`'s two parts: ``frozen`` with each
    ``None`` replaced by the tensor of ``trained`` (``{dotted.path: tensor}``) at that
    path. Raises ``ValueError`` naming a path that is in one part but has no place in
    the other (parts of two different partitions)."""
    used = set()

    def fill(path, leaf):
        if leaf is not None:
            return leaf
        if path not in trained:
            raise ValueError(
                f"combine: '{path}' is a hole in the frozen tree but not in the trained parameters "
                f"(the trained ones are {list(trained)[:3]}...): pass the two parts of one partition()"
            )
        used.add(path)
        return trained[path]

    out = tree.map_with_path(fill, frozen, is_leaf=lambda x: x is None)
    extra = [path for path in trained if path not in used]
    if extra:
        raise ValueError(
            f"combine: the trained parameter '{extra[0]}' has no hole in the frozen tree: "
            "pass the two parts of one partition()"
        )
    return out


def with_trained(params, trained, train: Train = None):
    """``params`` with its trained part (as :func:`trainable` cuts it) replaced by
    ``trained``."""
    if train is None:
        return {**trained, **{k: params[k] for k in FROZEN if k in params}}
    return tree.unflatten({**tree.flatten(params), **trained})


def init_state(params, optimizer, train: Train = None) -> TrainState:
    """``TrainState(params, optimizer.init(trainable(params, train)))``, packed
    (:func:`pack_state`)."""
    return pack_state(TrainState(params, optimizer.init(trainable(params, train))), train)


def pack_state(state: TrainState, train: Train = None) -> TrainState:
    """``state`` with its trained parameters (:func:`pack_params`) and each part of
    the optimizer state shaped like them (Adam's moments, ...) copied into one
    buffer each (a part already in one buffer is kept). Same values; use it on a
    state assembled by hand or loaded from a file, before :func:`petfunc.compile`
    traces the step with it (the compiled step takes the layout of its example)."""
    shapes = [leaf.shape for leaf in tree.tree_flatten(trainable(state.params, train))[0]]

    def shaped_like_params(node):
        # a part with the parameters' shapes, in order (torchopt keeps lists of leaves)
        leaves = tree.tree_flatten(node)[0]
        return bool(leaves) and [getattr(leaf, "shape", None) for leaf in leaves] == shapes

    def packed(node):
        # a part packed already (petfunc's adam packs its fresh moments) is kept
        leaves = tree.tree_flatten(node)[0]
        return node if tree.packed_range(leaves) is not None else tree.pack(node)

    opt_state = tree.tree_map(
        lambda node: packed(node) if shaped_like_params(node) else node,
        state.opt_state,
        is_leaf=shaped_like_params,
    )
    return TrainState(pack_params(state.params, train), opt_state)


def pack_params(params, train: Train = None):
    """``params`` with the trained part (:func:`trainable`) copied into one flat
    buffer, its tensors views of it (:func:`petfunc.tree.pack`).

    Same values. The training step then clips, updates and applies whole vectors
    without copying the parameters first, and its new parameters come out packed
    the same way. Training works on unpacked parameters too, a little slower.
    """
    return with_trained(params, tree.pack(trainable(params, train)), train)
