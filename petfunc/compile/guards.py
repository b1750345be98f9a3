"""The size checks that choose a compiled graph for a call: the relations the trace
assumed (:class:`TraceGuards`, checked at every call) and the sizes each compiled
graph assumed (:class:`GraphGuards`, one per graph)."""

from __future__ import annotations

import builtins
import re

import torch


def sympy_names() -> dict:
    """The names a guard's code is evaluated with. Imported on first use: the module
    imports sympy, too slow to load with every ``import petfunc``."""
    from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

    return SYMPY_INTERP


def specialised_size(size, shape_env) -> int | None:
    """The number a fake input's size stands for, if it is one after compiling: a
    plain int, or a symbol the shape environment replaced by a number; else None."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = shape_env.replace(size.node.expr)
    return int(expr) if expr.is_number else None


def _scope(inputs) -> dict:
    return {"L": {f"t{i}": t for i, t in enumerate(inputs)}}


class TraceGuards:
    """The size relations a trace assumed, checked at every call.

    They are equalities between data sizes, or of a data size and a number. For a
    well-formed batch they hold by construction (an edge array is as long as its
    partner array, positions have 3 columns). Any other constant means that some op
    read a size as a plain integer and the graph is valid for that size only (torch
    2.11's batching rule of ``mm``, for one, did so). Without this check such a graph
    would silently compute garbage for any other size; with it, the call fails and
    says which assumption broke.

    ``guards`` are Python expressions over ``L['t<i>']``, the graph's inputs;
    ``input_names`` name those inputs for the error message.
    """

    def __init__(self, guards, input_names):
        self.guards = list(guards)
        self.input_names = list(input_names)
        joined = " and ".join(f"({g})" for g in self.guards)
        self._code = builtins.compile(joined, "<petfunc trace guards>", "eval") if self.guards else None

    def check(self, inputs) -> None:
        """Raise ``ValueError`` naming every broken relation of the graph ``inputs``."""
        if self._code is None:
            return
        scope = _scope(inputs)
        if eval(self._code, sympy_names(), scope):
            return
        broken = [g for g in self.guards if not eval(g, sympy_names(), scope)]

        def readable(text):
            return re.sub(r"L\['t(\d+)'\]", lambda m: self.input_names[int(m.group(1))], text)

        raise ValueError(
            "compiled function: the input sizes break what the traced graph assumed: "
            + "; ".join(readable(g) for g in broken)
            + ". A batch from petfunc.make_batch satisfies these relations; if yours "
            "does and a size was fixed to a number here, the trace specialised on the "
            "example's size (a torch op read it as an integer)"
        )


class GraphGuards:
    """The sizes one compiled graph is valid for: the relations the backend assumed
    about the symbolic sizes (a guard expression from the shape environment), and
    the data sizes it made plain numbers, checked one by one.

    Those numbers are the sizes torch specialised (0 or 1) and the symbols the
    backend set equal to a number while compiling: the guard expression leaves both
    out (it takes static sizes as checked), so without them a graph specialised to
    a size of 2 would run for every size, wrongly. Parameter shapes (``static``
    inputs) are checked elsewhere.
    """

    def __init__(self, shape_env, fakes, static):
        expression = shape_env.produce_guards_expression(fakes)
        self._code = None if expression is None else builtins.compile(expression, "<petfunc guards>", "eval")
        self._fixed = [
            (index, dim, value)
            for index, (fake, is_static) in enumerate(zip(fakes, static))
            if not is_static
            for dim, size in enumerate(fake.shape)
            if (value := specialised_size(size, shape_env)) is not None
        ]

    def hold(self, inputs) -> bool:
        """Whether the graph's inputs ``inputs`` have sizes this graph is valid for."""
        return all(inputs[i].shape[d] == size for i, d, size in self._fixed) and (
            self._code is None or eval(self._code, sympy_names(), _scope(inputs))
        )
