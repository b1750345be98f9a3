"""A traced graph handed to a ``torch.compile`` backend, as Dynamo would hand it over,
and to inductor directly, without AOTAutograd (compile machinery: it calls
inductor's entry points, it patches nothing; the patches it holds while compiling
are :func:`petfunc._torch.registry.backend_patches`)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from pathlib import Path

import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._guards import TracingContext, tracing
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from petfunc._torch import addmm
from petfunc._torch.registry import backend_patches
from petfunc.compile import isa_probe
from petfunc.compile.trace import no_duck_shape


def _inductor_entry_points():
    """inductor's compiler for an already functional, decomposed graph (what
    torch.compile's inductor backend runs once AOTAutograd has traced the graph
    again), or None where this torch has other internals."""
    try:
        from torch._inductor.compile_fx import compile_fx_forward, create_compiler_config_extra
        from torch._inductor.decomposition import select_decomp_table
    except ImportError:
        return None
    return compile_fx_forward, create_compiler_config_extra, select_decomp_table


def compile_inductor_direct(graph: torch.fx.GraphModule, mode, fakes):
    """Compile an aten graph with inductor as torch.compile would, minus AOTAutograd.

    Given a graph from Dynamo, inductor's backend first has AOTAutograd trace it
    twice more (once to collect metadata, once to functionalize it and apply
    inductor's decompositions). Here the graph is already a flat aten graph with
    no autograd left in it, so one re-trace, functionalized and decomposed with
    the same table, gives what inductor's inference compiler
    (``compile_fx_forward``: joint-graph passes, then ``compile_fx_inner`` with its
    FX-graph cache) expects, the graph AOTAutograd would hand over: a shorter cold
    compile of a training step (``benchmarks/cold_compile.py --variants grouped
    aot``). A warm start pays the re-trace, where AOTAutograd's own cache would load
    the compiled code without any.

    Returns a callable on the graph's inputs, or None (this torch lacks those entry
    points, or inductor's config asks for freezing or the C++ wrapper, whose
    AOTAutograd path differs): then the caller uses the backend as usual.
    """
    config = torch._inductor.config
    entry = _inductor_entry_points()
    if entry is None or config.freezing or config.cpp_wrapper:
        return None
    compile_forward, config_extra, decompositions = entry
    with mode, enable_python_dispatcher():
        # the graph mutates fresh temporaries (the optimizer update, some of torch's
        # derivative formulas); inductor must get them functionalized, as from AOTAutograd
        functional = make_fx(
            torch.func.functionalize(graph, remove="mutations"),
            decomposition_table=decompositions(),
            tracing_mode="real",
        )(*fakes)
    output = next(n for n in functional.graph.nodes if n.op == "output")
    n_outputs = len(pytree.arg_tree_leaves(*output.args))
    # torch 2.11 builds the extra settings from inductor's config, 2.13 from the graph
    first = next(iter(inspect.signature(config_extra).parameters))
    extra = config_extra(config if first == "config" else functional)
    with tracing(TracingContext(mode)), enable_python_dispatcher():
        if addmm.ADDMM_MERGE_HOLD.installed:
            # split now, so that inductor's passes change nothing here (petfunc._torch.addmm)
            addmm.split_cpu_addmm(functional.graph)
            functional.recompile()
        compiled = compile_forward(
            functional,
            fakes,
            num_orig_model_outputs=n_outputs,
            num_example_inputs=len(fakes),
            compiler_config_extra=extra,
            is_inference=True,
        )

    def run(*inputs):
        # inductor's calling convention: one list, which it may empty
        return compiled(list(inputs))

    return run


def innermost(error: BaseException) -> BaseException:
    """The exception at the bottom of ``error``'s chain of causes (inductor wraps
    its errors in an ``InductorError`` that keeps the original as ``inner_exception``
    and suppresses the chain)."""
    while True:
        inner = getattr(error, "inner_exception", None) or error.__cause__
        if inner is None and not error.__suppress_context__:
            inner = error.__context__
        if not isinstance(inner, BaseException) or inner is error:
            return error
        error = inner


def cpp_vector_codegen_failed(error: BaseException) -> bool:
    """Whether ``error`` is an assertion of inductor's C++ code generator.

    WORKAROUND(torch<2.14): torch 2.11 and 2.13 assert, while writing a vectorized
    ``atomic_add``, that the index is a vector: a scatter into a buffer of one
    element (for instance a per-atom sum of a lone one-atom cell, a size torch
    specialises) has a constant index there. Such a graph compiles with scalar
    kernels. Only assertions raised in ``codegen/cpp.py`` count: any other failure
    is the caller's to see. Remove when torch 2.14 is the oldest supported.
    """
    inner = innermost(error)
    if not isinstance(inner, AssertionError) or inner.__traceback__ is None:
        return False
    frame = inner.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return Path(frame.tb_frame.f_code.co_filename).as_posix().endswith("_inductor/codegen/cpp.py")


def compile_graph(graph, mode, fakes, backend, options: dict, direct: bool):
    """``graph`` compiled by ``backend`` (a name or a backend callable) for the fake
    inputs ``fakes`` of ``mode``, with the inductor config ``options`` and petfunc's
    backend patches held; directly by inductor (:func:`compile_inductor_direct`)
    where ``direct``. A CPU graph whose vectorized C++ code inductor fails to write
    (:func:`cpp_vector_codegen_failed`) is compiled again with scalar kernels."""
    inner = torch._dynamo.lookup_backend(backend) if isinstance(backend, str) else backend
    on_cpu = all(t.device.type == "cpu" for t in fakes if isinstance(t, torch.Tensor))
    isa_probe.wait()

    def build(options):
        with contextlib.ExitStack() as stack:
            for patch in backend_patches(on_cpu):
                stack.enter_context(patch.scope())
            # the caller's options last: they take precedence over the patches' settings
            stack.enter_context(torch._inductor.config.patch(options))
            stack.enter_context(no_duck_shape())
            stack.enter_context(torch.no_grad())
            compiled = compile_inductor_direct(graph, mode, fakes) if direct else None
            return inner(graph, fakes) if compiled is None else compiled

    try:
        return build(options)
    except Exception as error:
        if not (on_cpu and backend == "inductor" and cpp_vector_codegen_failed(error)):
            raise
        warnings.warn(
            f"inductor failed to vectorize a CPU kernel of this graph ({innermost(error)!r}); "
            "compiling it again without vectorized kernels (cpp.simdlen=1): right, but slower",
            stacklevel=5,
        )
        return build({**options, "cpp.simdlen": 1})
