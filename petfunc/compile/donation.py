"""Packed and donated tensors: how the tensor leaves of a call map to graph inputs
and outputs.

Static tensors that are consecutive views of one buffer (a state made by
:func:`petfunc.init_state`: the parameters, each optimizer moment) enter the graph
as that one buffer, and outputs packed the same way leave it as one
(:class:`Layout`). With ``donate_argnums`` the outputs laid out like a donated
packed buffer are written into it by the graph itself (:func:`donation_runs`,
:func:`donate`). The call path flattens its pytrees with torch's C++ pytree
(:class:`FastTree`) and checks packed runs cheaply (:func:`run_buffer`).
"""

from __future__ import annotations

import torch
from torch.utils import _pytree as pytree

from petfunc import tree


try:  # torch's C++ pytree, on optree (a dependency of torchopt)
    import torch.utils._cxx_pytree as cxx_pytree
except ImportError:
    cxx_pytree = None


def packed_runs(tensors, eligible):
    """``[(start, stop)]``: runs of two or more consecutive ``eligible`` tensors that
    are consecutive views of one buffer (:func:`petfunc.tree.pack`)."""
    runs, start = [], 0
    while start < len(tensors):
        stop = start + 1
        if eligible[start]:
            # neighbours that are adjacent views of one base make the whole run so
            while (
                stop < len(tensors)
                and eligible[stop]
                and tree.packed_range(tensors[stop - 1 : stop + 1]) is not None
            ):
                stop += 1
        if stop - start >= 2:
            runs.append((start, stop))
            start = stop
        else:
            start += 1
    return runs


class Layout:
    """How a list of tensor leaves maps to a list of graph tensors: each packed run
    (:func:`packed_runs`) is one 1-d graph tensor, every other leaf one of its own.

    A train state made by :func:`petfunc.init_state` holds the parameters and each
    optimizer moment in one buffer; passing those buffers whole lets the traced
    optimizer step run on whole vectors (:func:`petfunc.tree.ravel` needs no copy),
    and the new state comes back packed the same way.
    """

    # output item -> the donated graph input it is written into (outputs only)
    donated: dict = {}

    def __init__(self, leaves, runs):
        first = dict(runs)
        # sizes of the leaves in runs (static); others may be symbolic and are not kept
        self.shapes = [None] * len(leaves)
        for start, stop in runs:
            for i in range(start, stop):
                self.shapes[i] = tuple(int(n) for n in leaves[i].shape)
        self.items = []  # (start, stop): a run; (index, None): a single leaf
        index = 0
        while index < len(leaves):
            stop = first.get(index)
            self.items.append((index, stop))
            index = stop if stop is not None else index + 1

    def pack(self, leaves):
        """Graph tensors from leaves (a run is copied only if not packed any more)."""
        return [leaves[i] if stop is None else tree.ravel(leaves[i:stop]) for i, stop in self.items]

    def unpack(self, tensors):
        """Leaves from graph tensors (views of the runs' buffers)."""
        out = []
        for (i, stop), t in zip(self.items, tensors):
            out += [t] if stop is None else tree.unravel(t, self.shapes[i:stop])
        return out

    def run_shapes(self, item):
        i, stop = self.items[item]
        return self.shapes[i:stop]

    def unpack_views(self, tensors, given=None):
        """:meth:`unpack` for the call path: each run's views made in one C++ call
        (``unflatten_dense_tensors``: faster than one view at a time, for the hundreds
        of leaves of a training state), or taken from ``given ({item: views of that tensor}).
        Not for traced tensors: :meth:`unpack` records plain views."""
        templates = self.__dict__.get("_templates")
        if templates is None:
            templates = self._templates = {
                i: [torch.empty(shape, device="meta") for shape in self.shapes[i:stop]]
                for i, stop in self.items
                if stop is not None
            }
        out = []
        for k, ((i, stop), t) in enumerate(zip(self.items, tensors)):
            if stop is None:
                out.append(t)
            elif given and k in given:
                out += given[k]
            else:
                out += torch._C._nn.unflatten_dense_tensors(t, templates[i])
        return out

    def __getstate__(self):  # the meta templates are rebuilt when needed
        state = dict(self.__dict__)
        state.pop("_templates", None)
        return state

    def key(self):
        return [stop for _, stop in self.items]


class FastTree:
    """Flatten and unflatten one fixed pytree structure with torch's C++ pytree
    (optree), for the call path.

    A training state has hundreds of leaves (parameters and two Adam moments, in
    nested dicts), which the C++ pytree flattens, compares and unflattens several
    times faster than the Python one. Used only where both give
    the same leaves in the same order (on torch 2.11-2.13 both order dict leaves by
    insertion and take ``None`` for a leaf), checked once through a copy of the
    structure holding distinct sentinels; any other structure (a node type
    registered with the Python pytree only) keeps the Python path.
    """

    def __init__(self, spec):
        if cxx_pytree is None:
            raise ValueError("torch's C++ pytree is not available")
        sentinels = [object() for _ in range(spec.num_leaves)]
        leaves, self.spec = cxx_pytree.tree_flatten(pytree.tree_unflatten(sentinels, spec))
        if len(leaves) != len(sentinels) or any(a is not b for a, b in zip(leaves, sentinels)):
            raise ValueError("the C++ pytree sees this structure differently")

    def flatten(self, tree_):
        """The leaves of ``tree_``, or None if its structure differs."""
        leaves, spec = cxx_pytree.tree_flatten(tree_)
        return leaves if spec == self.spec else None

    def unflatten(self, leaves):
        return cxx_pytree.tree_unflatten(leaves, self.spec)


class RunInfo:
    """What a packed run's leaves must look like for :func:`run_buffer`."""

    def __init__(self, leaves):
        self.shapes = [t.shape for t in leaves]
        self.dtype, self.device = leaves[0].dtype, leaves[0].device
        self.dtypes = [self.dtype] * len(leaves)
        self.contiguous = [True] * len(leaves)
        self.itemsize = leaves[0].element_size()
        self.offsets, offset = [], 0  # bytes from the first leaf
        for t in leaves:
            self.offsets.append(offset)
            offset += t.numel() * self.itemsize
        self.numel = offset // self.itemsize


def run_buffer(leaves, info: RunInfo) -> torch.Tensor | None:
    """The 1-d buffer of which ``leaves`` are consecutive contiguous views with the
    traced shapes and dtype (:func:`petfunc.tree.pack`), or None.

    Views at the right addresses read the buffer's memory, whichever tensor they
    were made from. (What :func:`petfunc.tree.packed_range` checks, plus shapes and
    dtypes, with a third of its attribute reads.)
    """
    base = leaves[0]._base
    if base is None or base.dtype != info.dtype or base.device != info.device or not base.is_contiguous():
        return None
    first = leaves[0].data_ptr()
    start, rest = divmod(first - base.data_ptr(), info.itemsize)
    if rest or start < 0 or start + info.numel > base.numel():
        return None
    if (
        [t.data_ptr() - first for t in leaves] != info.offsets
        or [t.shape for t in leaves] != info.shapes
        or [t.is_contiguous() for t in leaves] != info.contiguous
        or [t.dtype for t in leaves] != info.dtypes
    ):
        return None
    return base.view(-1)[start : start + info.numel]


def donation_runs(leaves, in_layout, placeholders, donated_inputs):
    """Output runs written into donated inputs: ``[(start, stop, graph input)]``.

    Scanning the output leaves in order, a window whose leaves have exactly the
    shapes, dtype and device of the leaves of a not yet used donated input run (a
    state's parameters, an optimizer moment) is paired with the first such run.
    The window then leaves the graph packed into that input's buffer, whether or
    not the function built it as views of one vector. Sizes that depend on the
    data are never compared (that would specialise the trace).
    """

    def layout_of(t):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or any(type(n) is not int for n in t.shape):
            return None
        return tuple(t.shape), t.dtype, t.device

    wanted = [
        (j, [(shape, placeholders[j].dtype, placeholders[j].device) for shape in in_layout.run_shapes(j)])
        for j in donated_inputs
    ]
    runs, position = [], 0
    while position < len(leaves) and wanted:
        for index, (j, layouts) in enumerate(wanted):
            window = leaves[position : position + len(layouts)]
            if len(window) == len(layouts) and all(layout_of(t) == want for t, want in zip(window, layouts)):
                runs.append((position, position + len(layouts), j))
                position += len(layouts)
                del wanted[index]
                break
        else:
            position += 1
    return runs


def donate(packed, donated: dict, placeholders) -> list:
    """Record, at the end of the traced function, the copies of the packed outputs
    ``packed[k]`` into their donated inputs ``placeholders[donated[k]]``. Inductor
    then computes the optimizer's elementwise update straight into the inputs'
    memory instead of new buffers.

    Any output that is a view of a donated input (a parameter passed through
    unchanged, a metric that returns one) is cloned first: otherwise a copy could
    read memory an earlier copy overwrote, or an output show the new values where
    the function returned the old ones. Returns ``packed`` with those clones.
    """
    targets = [placeholders[j] for j in donated.values()]
    packed = list(packed)
    for k, t in enumerate(packed):
        if isinstance(t, torch.Tensor):
            base = t._base if t._base is not None else t
            if any(base is p for p in targets):
                packed[k] = t.clone()
    for k, j in donated.items():
        placeholders[j].copy_(packed[k])
    return packed


def with_donated(outputs, donated, inputs, n_items):
    """The graph's outputs with each donated output put back: the input buffer
    the graph wrote it into."""
    rest = iter(outputs)
    return [inputs[donated[k]] if k in donated else next(rest) for k in range(n_items)]


def fast_tree(spec) -> FastTree | None:
    """A :class:`FastTree` of ``spec``, or None where the C++ pytree cannot serve it."""
    try:
        return FastTree(spec)
    except Exception:  # noqa: BLE001 - the Python pytree is always right
        return None
