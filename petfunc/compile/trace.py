"""Tracing with ``make_fx`` on fake inputs whose data sizes are symbols, and moving a
traced graph to another device."""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from petfunc._torch.registry import trace_patches
from petfunc.compile.logs import deferred_torch_errors


@contextlib.contextmanager
def no_duck_shape():
    """Give every input size its own symbol while tracing (no merging of equal sizes:
    3 structures and the 3 of xyz stay two symbols)."""
    config = torch.fx.experimental._config
    old = config.use_duck_shape
    config.use_duck_shape = False
    try:
        yield
    finally:
        config.use_duck_shape = old


def split_args(args):
    """``(tensors, constants, is_tensor, spec)`` of a pytree: its tensor leaves, its
    other leaves (None where a tensor is), which leaves are tensors, and its structure."""
    leaves, spec = pytree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensors = [x for x, t in zip(leaves, is_tensor) if t]
    constants = [None if t else x for x, t in zip(leaves, is_tensor)]
    return tensors, constants, is_tensor, spec


def merge_args(tensors, constants, is_tensor, spec):
    """The pytree :func:`split_args` took apart, with ``tensors`` for its tensor leaves."""
    it = iter(tensors)
    leaves = [next(it) if t else c for c, t in zip(constants, is_tensor)]
    return pytree.tree_unflatten(leaves, spec)


def fake_inputs(tensors, static, device=None):
    """``(mode, fakes)``: fake copies of ``tensors`` in a new fake-tensor mode whose shape
    environment does no duck shaping; symbolic sizes for data, fixed sizes where
    ``static`` is true; on ``device`` instead of each input's own device if given."""
    # imports sympy: too slow to load with every ``import petfunc``
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    fakes = []
    for t, is_static in zip(tensors, static):
        if t._base is not None or (device is not None and t.device != device):
            # a view is fake-ified with its base, whose sizes would not follow
            # ``static``; a stand-in on ``device`` is needed for another device (an
            # unwritten empty tensor: its pages are never touched)
            t = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device or t.device)
        kind = DimDynamic.STATIC if is_static else DimDynamic.DYNAMIC
        context = StatelessSymbolicContext(dynamic_sizes=[kind] * t.dim())
        fakes.append(mode.from_tensor(t, symbolic_context=context))
    return mode, fakes


def trace_device(tensors) -> torch.device | None:
    """The device to trace on in place of the inputs' own: the CPU when every input is
    on one accelerator (CUDA), else None (trace where the inputs are).

    WORKAROUND(torch>=2.11): ``torch.func.grad`` runs ``torch.autograd``'s engine, which
    executes the backward of CUDA tensors on its own per-device thread. Under
    ``make_fx`` with fake CUDA tensors that thread fails ("cannot access PyObject for
    Tensor - no interpreter set", on an H200). On the CPU the engine runs in the
    calling thread, and the aten graph is the same but for the device of the tensors
    it creates: :func:`move_graph` sets those afterwards. Remove when make_fx traces
    CUDA backward passes on every supported torch.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device.type in ("cpu", "meta") else torch.device("cpu")


def move_graph(graph_module: torch.fx.GraphModule, source: torch.device, target: torch.device) -> None:
    """Make a graph traced on ``source`` run on ``target``: the ``device`` of every
    op that creates a tensor (``arange``, ``zeros``, ``full``, ``scalar_tensor``,
    ``_to_copy``...) and the tensor constants kept on the module move from
    ``source`` to ``target``. The graph must not move data between devices itself
    (an explicit ``.cpu()`` in the traced function would move too)."""

    def moved(value):
        if isinstance(value, torch.device) and value.type == source.type:
            return target
        if isinstance(value, (list, tuple)):
            return type(value)(moved(v) for v in value)
        return value

    for node in graph_module.graph.nodes:
        if node.op == "call_function":
            node.args = moved(node.args)
            node.kwargs = {k: moved(v) for k, v in node.kwargs.items()}
        # the trace's fake values are tensors on ``source``: stale. Inductor's C++
        # wrapper takes the placeholders' "val" for the graph's inputs and refused
        # them ("Device mismatch between fake input and example input", torch 2.11,
        # H200); every backend re-traces the graph and makes its own
        for key in ("val", "tensor_meta"):
            node.meta.pop(key, None)
    for _, module in graph_module.named_modules():
        for name, value in list(vars(module).items()):
            # tensor constants: buffers, or plain attributes read by get_attr
            if isinstance(value, torch.Tensor) and value.device.type == source.type:
                setattr(module, name, value.to(target))
    graph_module.to(target)
    graph_module.recompile()


def shape_guards(shape_env, fakes, static) -> list:
    """What ``shape_env`` assumed about the sizes of the data inputs (``static``
    false), as Python expressions over ``L['t<i>']`` (the i-th graph input): sizes
    equal to each other or fixed to a number."""
    from torch._dynamo.source import LocalSource

    data = [i for i, s in enumerate(static) if not s]
    guards = shape_env.produce_guards(
        [fakes[i] for i in data], [LocalSource(f"t{i}") for i in data], ignore_static=False
    )
    # Kept: equalities between sizes, or of a size and a number. Dropped: strides
    # and offsets (inputs are made contiguous, and a contiguous view may start
    # anywhere), and inequalities, which come from the range every symbolic size is
    # given ([2, oo]: sizes 0 and 1 are the backend's business, it compiles a graph
    # of their own)
    return [g for g in guards if "==" in g and "stride()" not in g and "storage_offset()" not in g]


def _drop_unused_constants(graph_module: torch.fx.GraphModule) -> None:
    """Delete tensors kept on the traced module that no graph node reads.

    torch 2.11's make_fx keeps some tensors of the torch.func transforms (views of
    attention's q, k, v wrapped for grad) as module constants that no node uses;
    a backend would then try to fake-ify them as inputs and fail.
    """
    used = {node.target for node in graph_module.graph.nodes if node.op == "get_attr"}
    for name, _ in list(graph_module.named_buffers(recurse=False)) + list(
        graph_module.named_parameters(recurse=False)
    ):
        if name not in used:
            delattr(graph_module, name)


#: what to write instead of an operation whose output size (or value) depends on the
#: data, by the start of the aten operation's name (leading underscores dropped)
DATA_DEPENDENT_FIXES = {
    "nonzero": "multiply by the mask (x * mask) or use torch.where(mask, x, 0) on the whole tensor",
    "masked_select": "use torch.where(mask, x, 0) and sum, or multiply by the mask",
    "index": "use torch.where(mask, x, 0) or x * mask instead of boolean-mask indexing x[mask]",
    "unique": "use a table of fixed size (one entry per possible value) or find the values before compiling",
    "local_scalar_dense": "keep the value a tensor: no .item(), int(), float() or Python `if` on a tensor",
}


def data_dependent_operation(graph_module: torch.fx.GraphModule) -> str | None:
    """A sentence naming the first operation of a traced graph whose output size or
    value depends on the input data (an unbacked symbol: ``nonzero``, boolean-mask
    indexing, ``unique``, ``.item()``...) and what to write instead; ``None`` when
    every size follows from the input sizes. petfunc compiles one graph for symbolic
    input sizes, which cannot hold such an operation."""
    from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

    for node in graph_module.graph.nodes:
        if node.op != "call_function" or not free_unbacked_symbols(node.meta.get("val")):
            continue
        name = getattr(node.target, "__name__", str(node.target))
        base = name.split(".")[0].lstrip("_")
        fix = next(
            (text for key, text in DATA_DEPENDENT_FIXES.items() if base.startswith(key)),
            "make every size follow from the input sizes",
        )
        return (
            f"petfunc.compile: the function calls aten.{name}, whose output size or value depends on "
            f"the input data; one graph for every input size cannot hold it. Fix: {fix}"
        )
    return None


def trace(fn, inputs, static, context=contextlib.nullcontext) -> tuple[torch.fx.GraphModule, list]:
    """``(graph, guards)``: ``fn`` traced on fake copies of the graph inputs ``inputs``
    (symbolic sizes but where ``static``), under ``context()`` (a ``with`` block of the
    caller's) and petfunc's tracing patches, and the size relations the trace assumed
    (:func:`shape_guards`). Inputs on one accelerator are traced on the CPU and the
    graph moved (:func:`trace_device`). Dead nodes and unused constants are dropped.
    torch's error logs of a trace that ends in petfunc's own error are dropped
    (:func:`deferred_torch_errors`)."""
    device = trace_device(inputs)
    mode, fakes = fake_inputs(inputs, static, device)
    with contextlib.ExitStack() as stack:
        stack.enter_context(deferred_torch_errors())
        # vmap's symbolic-size rules for the whole trace: a vmap inside a grad (a
        # Hessian-vector loss, an ensemble) is replayed by the backward of that grad,
        # after the vmap's own block has exited (torch 2.12's C++ rule of bmm then
        # read the sizes as integers and fixed the atom count)
        for patch in trace_patches():
            stack.enter_context(patch.scope())
        stack.enter_context(context())
        stack.enter_context(mode)
        stack.enter_context(torch.no_grad())
        graph = make_fx(fn, tracing_mode="real")(*fakes)
    # before the graph moves (which drops the fake values this reads)
    data_dependent = data_dependent_operation(graph)
    if data_dependent is not None:
        raise ValueError(data_dependent)
    if device is not None:
        move_graph(graph, device, inputs[0].device)
    guards = shape_guards(mode.shape_env, fakes, static)
    # forward-mode AD (jvp) leaves unused checks such as aten.is_same_size, which
    # return Python bools that Dynamo cannot put in a graph: drop dead nodes
    graph.graph.eliminate_dead_code()
    _drop_unused_constants(graph)
    graph.recompile()
    return graph, guards
