""":class:`Compiled`: a traced function, its compiled graphs and the checks that
choose one for each call (see :mod:`petfunc.compile` for the whole design)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

from petfunc import tree
from petfunc._torch import settings
from petfunc.compile import inductor, isa_probe
from petfunc.compile.cache import cache_file, load_trace, save_trace
from petfunc.compile.donation import (
    Layout,
    RunInfo,
    donate,
    donation_runs,
    fast_tree,
    packed_runs,
    run_buffer,
    with_donated,
)
from petfunc.compile.guards import GraphGuards, TraceGuards
from petfunc.compile.trace import fake_inputs, merge_args, split_args, trace, trace_device
from petfunc.ops import fused_attention as fused


class Compiled:
    """A traced and compiled function with the signature of the original.

    ``from_cache`` tells whether the graph came from the trace cache; ``num_graphs``
    counts the graphs compiled for it (1 after the first call, and it must stay 1).
    """

    def __init__(
        self,
        fn: Callable,
        example_args: tuple,
        backend: Any = "inductor",
        options: dict | None = None,
        static_argnums=(0,),
        cache_key: str | None = None,
        aot_autograd: bool | None = None,
        donate_argnums=(),
        fused_attention: bool | None = None,
    ):
        self.fn = fn
        self.backend = backend
        if aot_autograd is None:
            aot_autograd = not settings.direct_inductor()
        self.aot_autograd = bool(aot_autograd)
        tensors = self._set_layout(example_args, static_argnums, donate_argnums)
        if backend == "inductor" and any(t.device.type == "cpu" for t in tensors):
            # inductor's C++ code generation will need it: probe while make_fx traces
            isa_probe.start()
        self._out_spec = None
        self._out_layout = None
        inputs = self._graph_inputs(tensors)
        self.fused_attention = self._use_fused_attention(fused_attention, inputs)
        cache = None if cache_key is None else cache_file(str(cache_key), self._signature(inputs))
        loaded = load_trace(cache) if cache is not None and cache.exists() else None
        self.from_cache = loaded is not None
        if loaded is not None:
            self.graph, self._out_spec, self._out_layout, trace_guards = loaded
        else:
            self.graph, trace_guards = trace(
                self._flat_fn, inputs, self._static, lambda: fused.use(self.fused_attention)
            )
            if cache is not None:
                save_trace(cache, self.graph, self._out_spec, self._out_layout, trace_guards)
                # compile the graph as later processes will load it: its inductor
                # cache entry then serves them (a freshly traced graph hashes
                # differently from its reloaded copy)
                reloaded = load_trace(cache)
                if reloaded is not None:
                    self.graph = reloaded[0]
        self._set_trace_guards(trace_guards, example_args)
        self._fast_out = fast_tree(self._out_spec)
        self.num_graphs = 0
        self.options = dict(options or {})
        self._entries = []  # (GraphGuards, compiled callable)

    def _set_layout(self, example_args, static_argnums, donate_argnums) -> list:
        """Which tensor leaves are static and donated, and how they map to graph
        inputs (packed runs); returns the tensor leaves of ``example_args``."""
        tensors, self._constants, self._is_tensor, self._spec = split_args(example_args)
        self._fast_in = fast_tree(self._spec)
        self._tensor_index = [i for i, t in enumerate(self._is_tensor) if t]
        self._constant_index = [i for i, t in enumerate(self._is_tensor) if not t]
        # which leaves have static sizes (parameters, optimizer state), which are donated
        static, donated = [], []
        for index, arg in enumerate(example_args):
            n = len([x for x in pytree.tree_leaves(arg) if isinstance(x, torch.Tensor)])
            static += [index in static_argnums] * n
            donated += [index in donate_argnums] * n
        if any(d and not s for d, s in zip(donated, static)):
            raise ValueError("donate_argnums: a donated argument must also be in static_argnums")
        # 0-d tensors enter the graph as [1], so that torch.compile(compiled.graph)
        # also works (Dynamo turns a 0-d float input into a symbolic Python float
        # and restarts its analysis to specialise it)
        self._scalar = [t.dim() == 0 for t in tensors]
        # packed static leaves (parameters, optimizer moments) enter as whole buffers
        self._in_layout = Layout(
            tensors, packed_runs(tensors, [s and t.dim() > 0 for t, s in zip(tensors, static)])
        )
        self._static = [True if stop is not None else static[i] for i, stop in self._in_layout.items]
        # donated packed buffers (graph input positions): the graph writes outputs into them
        self._donated_inputs = [
            k for k, (i, stop) in enumerate(self._in_layout.items) if stop is not None and donated[i]
        ]
        self._leaf_signature = [(t.dtype, t.device, t.dim()) for t in tensors]
        self._leaf_static_shapes = [tuple(t.shape) if s else None for t, s in zip(tensors, static)]
        self._run_info = {
            k: RunInfo(tensors[i:stop])
            for k, (i, stop) in enumerate(self._in_layout.items)
            if stop is not None
        }
        return tensors

    @staticmethod
    def _use_fused_attention(requested: bool | None, inputs) -> bool:
        """Whether to trace with the fused attention kernels (False, with a warning,
        where they cannot be built)."""
        if requested is None:
            requested = settings.fused_attention()
        if not requested:
            return False
        if trace_device(inputs) is not None or any(t.device.type != "cpu" for t in inputs):
            raise ValueError(
                "petfunc.compile: fused_attention=True is for functions on the CPU; "
                "on a GPU the attention is compiled from its decomposition"
            )
        return fused.library() is not None

    def _signature(self, inputs) -> tuple:
        """What besides the cache key a cached trace must have been made for."""
        return (
            # a data size of 0 or 1 is fixed in the trace (the shape environment
            # specialises them): an example of one structure traces another graph
            # than a batch (loading it for a batch failed its size guards)
            [
                (t.dtype, str(t.device), tuple(t.shape) if s else tuple(n if n < 2 else -1 for n in t.shape))
                for t, s in zip(inputs, self._static)
            ],
            # which leaves are tensors: pytree flattens None to a leaf, so the spec
            # alone does not tell (mesh, None, mesh) from (mesh, mesh, None)
            self._in_layout.key(),
            repr(self._spec),
            self._is_tensor,
            repr(self._constants),
            self._donated_inputs,
            self.fused_attention,
        )

    def _flat_fn(self, *placeholders):
        """The traced function: graph inputs in, graph outputs out (packed runs whole,
        donated outputs written into their inputs)."""
        graph_tensors = [
            t.reshape(()) if stop is None and self._scalar[i] else t
            for t, (i, stop) in zip(placeholders, self._in_layout.items)
        ]
        args = merge_args(self._in_layout.unpack(graph_tensors), self._constants, self._is_tensor, self._spec)
        out_leaves, self._out_spec = pytree.tree_flatten(self.fn(*args))
        # outputs packed like the inputs (the new parameters and moments) leave
        # the graph as their whole buffers too; donated inputs take the outputs
        # laid out like them (the new state)
        donation = donation_runs(out_leaves, self._in_layout, placeholders, self._donated_inputs)
        eligible = [isinstance(t, torch.Tensor) and t.dim() > 0 for t in out_leaves]
        for start, stop, _ in donation:
            eligible[start:stop] = [False] * (stop - start)
        runs = sorted(packed_runs(out_leaves, eligible) + [(start, stop) for start, stop, _ in donation])
        self._out_layout = Layout(out_leaves, runs)
        packed = self._out_layout.pack(out_leaves)
        item = {i: k for k, (i, _) in enumerate(self._out_layout.items)}
        self._out_layout.donated = {item[start]: j for start, _, j in donation}
        if donation:
            packed = donate(packed, self._out_layout.donated, placeholders)
        return tuple(t for k, t in enumerate(packed) if k not in self._out_layout.donated)

    def _set_trace_guards(self, guards, example_args):
        """Keep the size relations the trace assumed (:class:`TraceGuards`), with
        readable names of the graph inputs for their error message."""
        paths = [
            pytree.keystr(path)
            for path, leaf in pytree.tree_flatten_with_path(tuple(example_args))[0]
            if isinstance(leaf, torch.Tensor)
        ]
        names = [
            f"args{paths[i]}"
            if stop is None
            else f"the packed buffer of args{paths[i]} ... args{paths[stop - 1]}"
            for i, stop in self._in_layout.items
        ]
        self._trace_guards = TraceGuards(guards, names)

    def call_inputs(self, tensors):
        """The graph's inputs for the tensor leaves ``tensors``, checked.

        A packed run whose leaves are still consecutive, contiguous views of one
        buffer with the traced shapes is passed as that buffer after one pass of
        cheap checks. Anything else takes the full checks (and their error messages)
        and is copied into a buffer. Also returns ``{graph input: the run's leaves}``
        for the runs passed without a copy.
        """
        inputs, views = [], {}
        for k, (i, stop) in enumerate(self._in_layout.items):
            if stop is not None:
                buffer = run_buffer(tensors[i:stop], self._run_info[k])
                if buffer is not None:
                    inputs.append(buffer)
                    views[k] = tensors[i:stop]
                    continue
                self._check_inputs(tensors[i:stop], offset=i)
                inputs.append(tree.ravel(tensors[i:stop]))
            else:
                t = tensors[i]
                self._check_inputs([t], offset=i)
                # contiguous: the compiled code is specialised to the strides it was given
                inputs.append((t.reshape(1) if self._scalar[i] else t).contiguous())
        return inputs, views

    def _graph_inputs(self, tensors):
        """The graph's inputs for ``tensors`` (:meth:`call_inputs` without the views)."""
        return self.call_inputs(tensors)[0]

    def _check_inputs(self, tensors, offset=0):
        for index, (t, (dtype, device, dim), static) in enumerate(
            zip(tensors, self._leaf_signature[offset:], self._leaf_static_shapes[offset:]), start=offset
        ):
            if t.dtype != dtype or t.device != device or t.dim() != dim:
                raise TypeError(
                    f"compiled function: tensor input {index} is {t.dtype}, {t.device}, {t.dim()}-d; "
                    f"it was traced as {dtype}, {device}, {dim}-d"
                )
            if static is not None and tuple(t.shape) != static:
                raise ValueError(
                    f"compiled function: tensor input {index} (a parameter or optimizer "
                    f"state) has shape {tuple(t.shape)}, traced with {static}"
                )

    def _compile_for(self, inputs):
        """Compile the traced graph for sizes like those of ``inputs``.

        The backend gets the graph and fake inputs whose data sizes are symbols,
        as Dynamo would hand them over, without Dynamo re-tracing the (already
        traced) graph. The backend's assumptions about those sizes (for instance
        "at least 2", or a kernel choice that needs n > 16) are collected in the
        shape environment and turned into a guard expression checked at every call.
        """
        mode, fakes = fake_inputs(inputs, self._static)
        direct = self.backend == "inductor" and not self.aot_autograd
        compiled = inductor.compile_graph(self.graph, mode, fakes, self.backend, dict(self.options), direct)
        self._entries.append((GraphGuards(mode.shape_env, fakes, self._static), compiled))
        self.num_graphs += 1
        return compiled

    def _select(self, inputs):
        for guards, compiled in reversed(self._entries):
            if guards.hold(inputs):
                return compiled
        return self._compile_for(inputs)

    def __call__(self, *args):
        tensors = self.checked_tensors(args)
        inputs, views = self.call_inputs(tensors)
        self._trace_guards.check(inputs)
        donated = self._out_layout.donated
        if donated:
            given = inputs
            inputs = self._distinct_donations(inputs)
            # a donated run that came in as views of its buffer leaves as those same
            # views (the buffer now holds the new values; donation_runs paired it
            # with an output run of the same shapes): no new view objects. Not for a
            # buffer _distinct_donations copied: the views do not show that one
            views = {k: views[j] for k, j in donated.items() if j in views and inputs[j] is given[j]}
        with torch.no_grad():
            out = self._select(inputs)(*inputs)
        if donated:
            out = with_donated(out, donated, inputs, len(self._out_layout.items))
            leaves = self._out_layout.unpack_views(out, views)
        else:
            leaves = self._out_layout.unpack_views(out)
        if self._fast_out is not None:
            return self._fast_out.unflatten(leaves)
        return pytree.tree_unflatten(leaves, self._out_spec)

    def checked_tensors(self, args):
        """The tensor leaves of ``args``, whose structure and non-tensor leaves must
        be the example's."""
        leaves = None if self._fast_in is None else self._fast_in.flatten(args)
        same = leaves is not None
        if not same:
            leaves, spec = pytree.tree_flatten(args)
            same = spec == self._spec
        if not same or [isinstance(x, torch.Tensor) for x in leaves] != self._is_tensor:
            raise TypeError(
                "compiled function called with arguments whose structure differs from "
                "the example it was traced with"
            )
        for i in self._constant_index:
            a, b = leaves[i], self._constants[i]
            if a is not b and a != b:
                raise ValueError(
                    f"compiled function called with a non-tensor argument {a!r} that differs "
                    f"from the traced value {b!r}; trace again for other constants"
                )
        return [leaves[i] for i in self._tensor_index]

    def uses_fast_pytree(self) -> bool:
        """Whether calls flatten their arguments with torch's C++ pytree."""
        return self._fast_in is not None

    def eager_graph(self, *args):
        """Run the traced (uncompiled) graph: the reference for compiled == traced."""
        tensors, *_ = split_args(args)
        inputs = self._graph_inputs(tensors)
        self._trace_guards.check(inputs)
        donated = self._out_layout.donated
        if donated:
            inputs = self._distinct_donations(inputs)
        with torch.no_grad():
            out = self.graph(*inputs)
        if donated:
            out = with_donated(out, donated, inputs, len(self._out_layout.items))
        return pytree.tree_unflatten(self._out_layout.unpack(out), self._out_spec)

    def _distinct_donations(self, inputs):
        """``inputs`` where no two donated buffers share memory (a donated buffer
        passed twice, say, is copied: the graph would otherwise write both outputs
        into one)."""
        seen = set()
        inputs = list(inputs)
        for k in self._donated_inputs:
            pointer = inputs[k].data_ptr()
            if pointer in seen:
                inputs[k] = inputs[k].clone()
            seen.add(inputs[k].data_ptr())
        return inputs
