"""Tracing the artifact's function: ``make_fx`` with symbolic sizes, then
``torch.export`` with every data size dynamic (see :mod:`petfunc.export`)."""

from __future__ import annotations

import torch
from torch.fx.experimental.proxy_tensor import make_fx

from petfunc._torch.fft_meta import fft_meta
from petfunc.compile import fake_inputs, move_graph, no_duck_shape, trace_device
from petfunc.config import PETConfig
from petfunc.derivatives import energy_terms_forces_strain_derivative
from petfunc.export.inputs import (
    INPUTS,
    N_GRAPH_FIELDS,
    example_inputs,
    input_names,
    is_fixed,
    long_range_from_inputs,
    long_range_inputs,
    method_of,
)
from petfunc.graph import Neighbors
from petfunc.io import cast_params
from petfunc.model import PET


class _Flat(torch.nn.Module):
    """``torch.export`` wants a module; this one holds only the traced graph."""

    def __init__(self, graph):
        super().__init__()
        self.graph_module = graph

    def forward(self, *inputs):
        return self.graph_module(*inputs)


def trace(config: PETConfig, params, dtype=torch.float32, device="cpu", long_range: str | None = None):
    """The ``torch.export`` program of the artifact (weights as constants).

    ``long_range``: the reciprocal-space method of a long-range model, ``"p3m"``
    (default) or ``"ewald"``; ignored for other models.
    Returns ``(exported_program, example_inputs)``.
    """
    device = torch.device(device)
    method = method_of(config, long_range)
    names = input_names(method)
    positions, cell, neighbors = example_inputs(config, dtype, device, method)
    example = (positions, cell, *neighbors[:N_GRAPH_FIELDS])
    if method:
        example += long_range_inputs(neighbors, cell, config, method)
    # for a GPU: traced on the CPU, then moved, as petfunc.compile does (see trace_device)
    traced_on = trace_device(list(example))
    params = cast_params(params, dtype, traced_on or device)
    fn = energy_terms_forces_strain_derivative(PET(config).energy_terms)

    def flat(positions, cell, *fields):
        long_range = long_range_from_inputs(method, fields[N_GRAPH_FIELDS:])
        return fn(params, positions, cell, Neighbors(*fields[:N_GRAPH_FIELDS], long_range=long_range))

    mode, fakes = fake_inputs(list(example), [False] * len(example), traced_on)
    with mode, torch.no_grad(), fft_meta():
        graph = make_fx(flat, tracing_mode="real")(*fakes)
    graph.graph.eliminate_dead_code()
    if traced_on is not None:
        move_graph(graph, traced_on, device)
    graph.recompile()

    auto = torch.export.Dim.AUTO
    dynamic = tuple(
        {d: auto for d in range(t.dim()) if not is_fixed(name, d)} for name, t in zip(names, example)
    )
    with torch.no_grad(), no_duck_shape(), fft_meta():
        program = torch.export.export(_Flat(graph), example, dynamic_shapes=(dynamic,), strict=False)
    check_dynamic(program, names)
    return program, example


def check_dynamic(program, names=INPUTS) -> None:
    """Every data size must have stayed symbolic: not specialised to a number and
    not bounded beyond export's own ``[2, oo]`` (the inputs always hold at least the
    padding structure, so no size is 0 or 1). A bound would make the artifact refuse,
    at run time, batches that the eager model takes. The equalities between sizes
    that the graph needs (``centers`` and ``neighbors`` have one length, ...) are
    export's guards, checked at every call; the tests run the artifact on batches of
    many sizes against them."""
    from torch.utils._sympy.numbers import int_oo  # imports sympy: too slow for every petfunc import

    user_inputs = set(program.graph_signature.user_inputs)
    user = [n for n in program.graph.nodes if n.op == "placeholder" and n.name in user_inputs]
    for name, node in zip(names, user):
        value = node.meta.get("val")
        for d, size in enumerate(value.shape):
            if not is_fixed(name, d) and not isinstance(size, torch.SymInt):
                raise RuntimeError(f"export specialised size {d} of {name!r} to {size}")
    for symbol, bounds in program.range_constraints.items():
        if bounds.lower > 2 or bounds.upper != int_oo:
            raise RuntimeError(f"export bounded the size {symbol} to [{bounds.lower}, {bounds.upper}]")
