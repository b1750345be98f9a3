"""The trace cache: traced graphs kept in files, so that a later process with the
same key, the same petfunc source, the same torch and the same input signature loads
the graph instead of tracing it again (``make_fx`` takes seconds to tens of seconds
for PET's derivatives).

The file is a pickle of the graph as plain data (:func:`save_trace`), trusted like
inductor's own cache of generated code next to it, after a header and the SHA-256
of the pickle: a damaged file (bit rot, a cut copy) is never unpickled, only traced
again.
"""

from __future__ import annotations

import functools
import hashlib
import operator
import pickle
import warnings
from pathlib import Path

import torch

from petfunc._files import atomic_write
from petfunc._torch import settings
from petfunc.compile.donation import Layout


def trace_cache_dir() -> Path | None:
    """Folder of cached traces: ``$PETFUNC_TRACE_CACHE_DIR``, else ``petfunc_traces``
    in inductor's cache folder (``$TORCHINDUCTOR_CACHE_DIR`` or
    ``/tmp/torchinductor_$USER``). ``PETFUNC_TRACE_CACHE=0`` turns caching off
    (``None``)."""
    if not settings.trace_cache():
        return None
    folder = settings.trace_cache_folder()
    if folder:
        return Path(folder)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "petfunc_traces"


@functools.lru_cache(maxsize=1)
def source_hash() -> str:
    """Hash of petfunc's own source: a trace is only reused by the code that made it."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_file(key: str, signature) -> Path | None:
    """The cache file of a trace of the function ``key`` names for inputs of
    ``signature``, or None where caching is off."""
    folder = trace_cache_dir()
    if folder is None:
        return None
    text = repr((key, source_hash(), torch.__version__, signature))
    return folder / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".fx.pkl")


#: the first bytes of a trace cache file, before the SHA-256 of its pickle
HEADER = b"petfunc.trace 1\n"


def _sealed(data: bytes) -> bytes:
    """``data`` behind :data:`HEADER` and its SHA-256."""
    return HEADER + hashlib.sha256(data).digest() + data


def _unsealed(sealed: bytes) -> bytes:
    """The pickle of a trace cache file, checked against its SHA-256."""
    if not sealed.startswith(HEADER):
        raise ValueError("it is not a petfunc trace cache file")
    digest, data = sealed[len(HEADER) : len(HEADER) + 32], sealed[len(HEADER) + 32 :]
    if hashlib.sha256(data).digest() != digest:
        raise ValueError("its content does not match its SHA-256: damaged")
    return data


class _NodeRef:
    """A graph node named in a pickled graph's arguments."""

    def __init__(self, name: str):
        self.name = name


def _graph_state(graph_module: torch.fx.GraphModule) -> dict:
    """A traced graph as plain data: nodes with their targets, arguments and names, and
    the graph's constants.

    Pickling the GraphModule itself stores its Python code, which torch.fx traces again
    on load, with proxies for the inputs. torch 2.11 cannot pass a proxy inside a size
    list to an ATen operator (``aten.expand(eye, [1, n, 3])``), so graphs of P3M lattices
    did not load there. Plain data is rebuilt node by node, running nothing.
    """
    nodes = []
    for node in graph_module.graph.nodes:
        target = node.target
        if isinstance(target, torch._ops.OpOverload):
            # operator overloads do not pickle (their schema binds a C++ object); no
            # other target is a tuple (functions, or names of inputs and attributes)
            target = (target.namespace, target._opname, target._overloadname)
        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), lambda n: _NodeRef(n.name))
        nodes.append((node.op, node.name, target, args, kwargs))
    attributes = {
        n.target: operator.attrgetter(n.target)(graph_module)
        for n in graph_module.graph.nodes
        if n.op == "get_attr"
    }
    return {"nodes": nodes, "attributes": attributes}


def _graph_from_state(state: dict) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    made = {}

    def resolved(value):
        return torch.fx.node.map_aggregate(value, lambda v: made[v.name] if isinstance(v, _NodeRef) else v)

    for op, name, target, args, kwargs in state["nodes"]:
        if isinstance(target, tuple):
            namespace, opname, overload = target
            target = getattr(getattr(getattr(torch.ops, namespace), opname), overload)
        node = graph.create_node(op, target, resolved(args), resolved(kwargs), name=name)
        if node.name != name:
            raise ValueError(f"node {name!r} came back as {node.name!r}")
        made[name] = node
    graph.lint()
    return torch.fx.GraphModule(state["attributes"], graph)


def load_trace(path: Path):
    """``(graph, output spec, output layout, trace guards)`` from a cache file, or
    ``None`` (missing or unreadable)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        # a graph's code is re-run by torch.fx on load; it may name this lazily
        # imported module (torch 2.13)
        import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401, PLC0415 - only where a cached graph loads
    except ImportError:
        pass
    try:
        with warnings.catch_warnings():
            # unpickling a TreeSpec warns about its own deprecated LeafSpec check (torch 2.13)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            state, out_spec, out_layout, guards = pickle.loads(_unsealed(data))
        if not isinstance(state, dict) or not isinstance(out_layout, Layout):
            raise TypeError(f"holds a {type(state).__name__} and a {type(out_layout).__name__}")
        graph = _graph_from_state(state)
        if not isinstance(guards, list) or not all(isinstance(g, str) for g in guards):
            raise TypeError("its trace guards are not a list of strings")
        return graph, out_spec, out_layout, guards
    except Exception as error:  # noqa: BLE001 - a damaged or foreign file: trace again
        warnings.warn(
            f"petfunc.compile: ignoring the unreadable trace cache file {path} ({error})", stacklevel=3
        )
        return None


def save_trace(path: Path, graph, out_spec, out_layout, guards) -> None:
    """Write atomically; a failure to write only costs the next process a trace."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = pickle.dumps((_graph_state(graph), out_spec, out_layout, guards))
        atomic_write(path, lambda handle: handle.write(_sealed(data)))
    except Exception as error:  # noqa: BLE001 - a failure to write only costs a trace
        warnings.warn(f"petfunc.compile: could not write the trace cache file {path} ({error})", stacklevel=3)
