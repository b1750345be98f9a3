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

from collections.abc import Sequence
from typing import Any, NamedTuple

from petfunc import tree


FROZEN = ("composition_weights", "energy_scale")


class TrainState(NamedTuple):
    """Parameters (including the frozen composition and scale) and optimizer state."""

    params: Any
    opt_state: Any


# metatrain's default selection for ``finetune: {method: heads}``
HEADS = ("node_heads", "edge_heads", "node_last_layers", "edge_last_layers")


def trainable(params, train: Sequence[str] | None = None):
    """The trained part of a PET parameter tree.

    ``train=None``: everything but the composition weights and the energy scale, as a
    tree of the same nesting. ``train``: a sequence of dotted-path prefixes (for
    example :data:`HEADS`, metatrain's ``finetune: {method: heads}``); the trained
    part is then a flat ``{dotted.path: tensor}`` dict of the parameters whose path
    starts with one of them (string prefixes, as metatrain matches module names),
    and everything else is held fixed. Raises ``ValueError`` when nothing matches.
    """
    if train is None:
        return {k: v for k, v in params.items() if k not in FROZEN}
    if isinstance(train, str):
        raise TypeError("train must be a sequence of path prefixes, not one string")
    selected = {
        path: value
        for path, value in tree.flatten(params).items()
        if path.split(".")[0] not in FROZEN and any(path.startswith(prefix) for prefix in train)
    }
    if not selected:
        top = sorted({p.split(".")[0] for p in tree.flatten(params)} - set(FROZEN))
        raise ValueError(
            f"no parameter path starts with any of {list(train)}; the parameters are under {top}"
        )
    return selected


def with_trained(params, trained, train: Sequence[str] | None = None):
    """``params`` with its trained part (as :func:`trainable` cuts it) replaced by
    ``trained``."""
    if train is None:
        return {**trained, **{k: params[k] for k in FROZEN if k in params}}
    return tree.unflatten({**tree.flatten(params), **trained})


def init_state(params, optimizer, train: Sequence[str] | None = None) -> TrainState:
    """``TrainState(params, optimizer.init(trainable(params, train)))``, packed
    (:func:`pack_state`)."""
    return pack_state(TrainState(params, optimizer.init(trainable(params, train))), train)


def pack_state(state: TrainState, train: Sequence[str] | None = None) -> TrainState:
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


def pack_params(params, train: Sequence[str] | None = None):
    """``params`` with the trained part (:func:`trainable`) copied into one flat
    buffer, its tensors views of it (:func:`petfunc.tree.pack`).

    Same values. The training step then clips, updates and applies whole vectors
    without copying the parameters first, and its new parameters come out packed
    the same way. Training works on unpacked parameters too, a little slower.
    """
    return with_trained(params, tree.pack(trainable(params, train)), train)
