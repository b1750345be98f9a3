"""``petfunc.compile(fn, *example_args)``: trace once with ``make_fx``, compile the
graph for symbolic sizes (what ``torch.compile(dynamic=True, fullgraph=True)`` does,
without Dynamo's second trace).

The function (a train step, an energy-forces-stress evaluation, a Hessian...) may
take and return any pytree of tensors (dicts, lists, NamedTuples such as
:class:`~petfunc.TrainState`, :class:`~petfunc.data.Batch`, torchopt states).

1. The pytree is flattened; tensors become graph inputs, everything else is a
   constant that must not change between calls.
2. ``make_fx`` traces the whole function, torch.func transforms included, into one
   aten graph, on fake inputs whose data sizes are symbols (parameter sizes, in
   ``static_argnums``, stay fixed). Duck shaping is off, so equal sizes at trace
   time (say 3 structures and the 3 of xyz) are not merged into one symbol.
   Inputs on one GPU are traced as CPU tensors and the graph is moved to the GPU
   afterwards (:func:`trace_device`, :func:`_move_graph`).
3. At the first call the ``torch.compile`` backend (``"inductor"``,
   ``"aot_eager"``, ... or a backend callable) compiles that graph, given fake
   inputs with symbolic sizes, exactly as Dynamo hands a graph to a backend. Dynamo
   itself is skipped: the graph is already a flat aten graph, and re-tracing it
   cost 15 s of a 30 s warm compile of the training step. What Dynamo's guards
   did is kept: every assumption the backend makes about the sizes (at least 2; a
   kernel choice for n > 16; ...) is recorded in the shape environment and checked
   at every call (about 10 us); a call that breaks it compiles another graph, as a
   Dynamo recompilation would. Dtype, device, rank and the fixed parameter shapes
   are checked too, with a clear error. For inductor, AOTAutograd is skipped as
   well: it would trace the graph twice more (metadata, then functionalization and
   inductor's decompositions); one functionalizing, decomposing re-trace goes
   straight to inductor's inference compiler instead, 5-15 s less per cold
   compile of a training step (``aot_autograd=True`` or
   ``PETFUNC_DIRECT_INDUCTOR=0`` restores the usual path, whose cache gives
   faster warm starts). Inductor's probe of the CPU's vector instruction sets
   runs in a background thread while ``make_fx`` traces
   (:func:`petfunc._torch.cpu_kernels.start_isa_probe`).
4. Any later batch, whatever its numbers of structures, atoms, edges and
   neighbours, reuses the graph, provided no size is 0 or 1 (torch specialises
   those): :func:`petfunc.data.make_batch` pads batches for this.
5. Calls run under ``torch.no_grad()``: gradients are graph outputs, never a
   backward through the compiled region (which would silently drop second-order
   terms).
6. On CPU, inductor's C++ kernels are built a few per library rather than one
   ``g++`` run each (:mod:`petfunc._torch.cpu_kernels`): a third less cold compile time.
   Inductor's analysis of how each vectorized load moves along the vector lane
   expands polynomial indices instead of calling ``sympy.simplify``
   (:mod:`petfunc._torch.vec_strides`): the same code, 4 s less of a carbon cold compile.
   CPU ``addmm`` is split into ``mm`` plus an add that fuses into the next kernel
   (:func:`_unfuse_addmm`), before inductor's passes, whose merge of ``mm + add``
   is held back (:func:`hold_cpu_addmm_merge`); the scheduler tries fewer fusion
   partners per buffer (:func:`fusion_pair_attempts`, the same code). Together
   about 4 s less of inductor's work on the carbon training step.
7. Static tensors that are consecutive views of one buffer (a state made by
   :func:`petfunc.init_state`: the parameters, each optimizer moment) enter the
   graph as that one buffer, and outputs packed the same way leave it as one. The
   traced optimizer step then runs on whole vectors. Any later call may pass
   other tensors: a run that is not packed any more is copied into a buffer first.
8. ``donate_argnums`` (as in JAX): outputs laid out like a donated packed buffer
   (the new parameters, each new moment) are written into it by the graph itself,
   so inductor's update kernel overwrites the old state in place. The donated
   argument must not be used after the call.

``compiled.num_graphs`` counts the graphs compiled for this function: 1 after the
first call, and it must stay 1.

**Trace cache.** ``make_fx`` takes 10-30 s for PET's derivatives, in every new
process. With ``cache_key`` the traced graph is kept in a file
(:func:`trace_cache_dir`) and a later process with the same key, the same
petfunc source, the same torch and the same input signature loads it instead of
tracing (about 1 s). The key must name everything the traced function bakes in
that is not an input (the architecture, loss weights, schedule constants...);
:class:`petfunc.ase.PETCalculator` uses it, keyed by its config. The file is a
pickle, trusted like inductor's own cache of generated code next to it.
"""

from __future__ import annotations

import builtins
import contextlib
import functools
import hashlib
import inspect
import operator
import os
import pickle
import re
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree


try:  # torch's C++ pytree, on optree (a dependency of torchopt)
    import torch.utils._cxx_pytree as _cxx_pytree
except ImportError:
    _cxx_pytree = None

from petfunc import tree
from petfunc._files import atomic_write
from petfunc._torch import cpu_kernels as _cpu_kernels
from petfunc._torch import vec_strides as _vec_strides
from petfunc._torch.fft_meta import fft_meta
from petfunc._torch.patch import scoped_attribute
from petfunc._torch.vmap_rules import symbolic_vmap_rules
from petfunc.ops import fused_attention as _fused


@contextlib.contextmanager
def no_duck_shape():
    """Give every input size its own symbol while tracing (no merging of equal sizes)."""
    config = torch.fx.experimental._config
    old = config.use_duck_shape
    config.use_duck_shape = False
    try:
        yield
    finally:
        config.use_duck_shape = old


def _example_size(sizevars, expr) -> int | None:
    """The value of a symbolic size for the example inputs, without a guard; None
    when it has none. (torch 2.13 renamed inductor's ``size_hint`` to
    ``optimization_hint``: a lookup of the old name alone fails there, and took the
    cascade helper for every float32 sum, softmax rows and layer norms included,
    which made those kernels 4-5x slower.)"""
    for name in ("optimization_hint", "size_hint"):
        method = getattr(sizevars, name, None)
        if method is not None:
            try:
                return int(method(expr))
            except Exception:
                return None
    return None


@contextlib.contextmanager
def unguarded_sum_helper():
    """Let inductor's C++ backend choose its float32 summation scheme without a guard.

    For a float32 sum over more than 4096 elements inductor's C++ kernels use a
    cascade-sum helper (better round-off). With a symbolic length it decides on the
    example's length and guards that decision (torch 2.13: ``guard_or_false(n >
    4096)``; 2.11: ``check_leq``/``check_lt``), so a graph traced on a small batch
    compiles again for a batch of more than 4096 atoms or edges, and one traced on a
    large batch for a small one. Both kernels are right for every length; only the
    rounding of long sums differs. Here the choice follows the example's length and
    records no guard. (A graph loaded from inductor's cache never re-added that guard,
    so warm starts already behaved so.)
    """
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.virtualized import V
    except ImportError:
        yield
        return
    kernel = getattr(cpp, "CppKernel", None)
    original = getattr(kernel, "need_use_acc_helper", None)
    if original is None:
        yield
        return

    def need_use_acc_helper(self, reduction_type, dtype, use_scalar):
        if reduction_type != "sum" or dtype != torch.float or self.call_ranges is None:
            return original(self, reduction_type, dtype, use_scalar)
        length = functools.reduce(operator.mul, self.call_ranges[self.reduction_depth :], 1)
        hint = _example_size(V.graph.sizevars, length)
        # no example value: the helper, the safe choice, as inductor makes it
        return hint is None or hint > 4096

    kernel.need_use_acc_helper = need_use_acc_helper
    try:
        yield
    finally:
        kernel.need_use_acc_helper = original


def _split(args):
    leaves, spec = pytree.tree_flatten(args)
    is_tensor = [isinstance(x, torch.Tensor) for x in leaves]
    tensors = [x for x, t in zip(leaves, is_tensor) if t]
    constants = [None if t else x for x, t in zip(leaves, is_tensor)]
    return tensors, constants, is_tensor, spec


def _merge(tensors, constants, is_tensor, spec):
    it = iter(tensors)
    leaves = [next(it) if t else c for c, t in zip(constants, is_tensor)]
    return pytree.tree_unflatten(leaves, spec)


def _fake_inputs(tensors, static, device=None):
    """Fake copies of the inputs: symbolic sizes for data, static sizes for ``static``;
    on ``device`` instead of each input's own device if given."""
    from torch._subclasses.fake_tensor import FakeTensorMode
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

    ``torch.func.grad`` runs ``torch.autograd``'s engine, which executes the backward
    of CUDA tensors on its own per-device thread. Under ``make_fx`` with fake CUDA
    tensors that thread fails on torch 2.11 ("cannot access PyObject for Tensor - no
    interpreter set", measured on an H200). On the CPU the engine runs in the calling
    thread, and the aten graph is the same but for the device of the tensors it
    creates: :func:`_move_graph` sets those afterwards.
    """
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        return None
    (device,) = devices
    return None if device.type in ("cpu", "meta") else torch.device("cpu")


def _move_graph(graph_module: torch.fx.GraphModule, source: torch.device, target: torch.device) -> None:
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


def _shape_guards(shape_env, fakes, static) -> list:
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


def _packed_runs(tensors, eligible):
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


class _Layout:
    """How a list of tensor leaves maps to a list of graph tensors: each packed run
    (:func:`_packed_runs`) is one 1-d graph tensor, every other leaf one of its own.

    A train state made by :func:`petfunc.init_state` holds the parameters and each
    optimizer moment in one buffer; passing those buffers whole lets the traced
    optimizer step run on whole vectors (:func:`petfunc.tree.ravel` needs no copy),
    and the new state comes back packed the same way.
    """

    # output item -> the donated graph input it is written into (outputs only)
    donated: dict = {}

    def __init__(self, leaves, runs):
        first = {start: stop for start, stop in runs}
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
        (``unflatten_dense_tensors``; 2 µs a leaf instead of 3.3, 345 leaves a qm9
        training step), or taken from ``given`` ({item: views of that tensor}).
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


class _FastTree:
    """Flatten and unflatten one fixed pytree structure with torch's C++ pytree
    (optree), for the call path.

    A training state has hundreds of leaves (366 for a qm9 step: parameters and two
    Adam moments, in nested dicts); the Python pytree took 1.1 ms a call to flatten,
    compare and unflatten them, the C++ one about 0.35 ms. Used only where both give
    the same leaves in the same order (on torch 2.11-2.13 both order dict leaves by
    insertion and take ``None`` for a leaf), checked once through a copy of the
    structure holding distinct sentinels; any other structure (a node type
    registered with the Python pytree only) keeps the Python path.
    """

    def __init__(self, spec):
        if _cxx_pytree is None:
            raise ValueError("torch's C++ pytree is not available")
        sentinels = [object() for _ in range(spec.num_leaves)]
        leaves, self.spec = _cxx_pytree.tree_flatten(pytree.tree_unflatten(sentinels, spec))
        if len(leaves) != len(sentinels) or any(a is not b for a, b in zip(leaves, sentinels)):
            raise ValueError("the C++ pytree sees this structure differently")

    def flatten(self, tree_):
        """The leaves of ``tree_``, or None if its structure differs."""
        leaves, spec = _cxx_pytree.tree_flatten(tree_)
        return leaves if spec == self.spec else None

    def unflatten(self, leaves):
        return _cxx_pytree.tree_unflatten(leaves, self.spec)


class _RunInfo:
    """What a packed run's leaves must look like for :func:`_run_buffer`."""

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


def _run_buffer(leaves, info: _RunInfo) -> torch.Tensor | None:
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


def _donation_runs(leaves, in_layout, placeholders, donated_inputs):
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


def _donate(packed, donated: dict, placeholders) -> list:
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


def _with_donated(outputs, donated, inputs, n_items):
    """The graph's outputs with each donated output put back: the input buffer
    the graph wrote it into."""
    rest = iter(outputs)
    return [inputs[donated[k]] if k in donated else next(rest) for k in range(n_items)]


def _fast_tree(spec) -> _FastTree | None:
    try:
        return _FastTree(spec)
    except Exception:  # noqa: BLE001 - the Python pytree is always right
        return None


# ---------------------------------------------------------------------------------------
# trace cache


def trace_cache_dir() -> Path | None:
    """Folder of cached traces: ``$PETFUNC_TRACE_CACHE_DIR``, else ``petfunc_traces``
    in inductor's cache folder (``$TORCHINDUCTOR_CACHE_DIR`` or
    ``/tmp/torchinductor_$USER``). ``PETFUNC_TRACE_CACHE=0`` turns caching off
    (``None``)."""
    if os.environ.get("PETFUNC_TRACE_CACHE", "1") == "0":
        return None
    folder = os.environ.get("PETFUNC_TRACE_CACHE_DIR")
    if folder:
        return Path(folder)
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir()) / "petfunc_traces"


@functools.lru_cache(maxsize=1)
def _source_hash() -> str:
    """Hash of petfunc's own source: a trace is only reused by the code that made it."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted(package.rglob("*.py")):
        digest.update(path.relative_to(package).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@functools.lru_cache(maxsize=1)
def _codegen_hash() -> str:
    """Hash of the petfunc modules that change what inductor generates for a given
    graph (the summation choice above, the FFT shape functions, the kernel
    grouping, the stride analysis)."""
    digest = hashlib.sha256()
    package = Path(__file__).resolve().parents[1]
    for path in sorted([*package.joinpath("compile").glob("*.py"), *package.joinpath("_torch").glob("*.py")]):
        digest.update(path.read_bytes())
    return digest.hexdigest()[:32]


def _unfuse_addmm(graph: torch.fx.Graph) -> None:
    """Split every CPU ``addmm(bias, a, b)`` into ``mm(a, b) + bias``.

    Inductor merges ``mm + add`` into ``addmm`` on CPU (on GPUs it splits it again
    where the sum only feeds elementwise ops). ATen's CPU ``addmm`` first copies the
    broadcast bias into the output and then has the GEMM accumulate onto it: one
    more write and read of every product. Split, the add fuses into the kernel that
    reads the product next (an activation, a norm, the next gather), for each of the
    ~50 (qm9) to ~60 (carbon) linear layers and residual sums of a training step;
    where the product only feeds another matmul, the add costs what the copy did.
    Measured side by side (``benchmarks/compare_step.py``): qm9 step 0.935x, carbon
    0.984x.
    """
    aten = torch.ops.aten
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target is not aten.addmm.default:
            continue
        if node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1:
            continue
        bias, a, b = node.args
        value = node.meta.get("val")
        if (
            not isinstance(bias, torch.fx.Node)
            or value is None
            or value.device.type != "cpu"
            or not node.users
        ):
            continue
        with graph.inserting_before(node):
            product = graph.call_function(aten.mm.default, (a, b))
            product.meta["val"] = aten.mm.default(a.meta["val"], b.meta["val"])
            total = graph.call_function(aten.add.Tensor, (product, bias))
            total.meta["val"] = value
        node.replace_all_uses_with(total)
        graph.erase_node(node)


def early_addmm_split() -> bool:
    """Whether CPU ``addmm`` is split before inductor's passes rather than after
    (:func:`hold_cpu_addmm_merge`); ``PETFUNC_EARLY_ADDMM_SPLIT=0`` turns it off."""
    return os.environ.get("PETFUNC_EARLY_ADDMM_SPLIT", "1") != "0"


def _merge_check_replacement():
    """The replacement of inductor's merge check (see :func:`hold_cpu_addmm_merge`), or None."""
    try:
        from torch._inductor.fx_passes import post_grad
    except ImportError:  # pragma: no cover - inductor unavailable
        return None
    original = getattr(post_grad, "should_prefer_unfused_addmm", None)
    if original is None or not hasattr(post_grad, "is_valid_addmm_fusion"):
        return None  # another torch: its merge stays, and the post-grad pass splits after it

    def prefer_unfused(match):
        bias = match.kwargs.get("inp")
        value = bias.meta.get("val") if isinstance(bias, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and value.device.type == "cpu":
            return True
        return original(match)

    return post_grad, "should_prefer_unfused_addmm", prefer_unfused


_merge_hold = scoped_attribute(_merge_check_replacement)


def hold_cpu_addmm_merge():
    """A ``with`` block in which inductor leaves CPU ``mm + add`` unmerged.

    :func:`_unfuse_addmm` used to run only as a post-grad pass, after inductor's
    own passes had merged every CPU ``mm + add`` into ``addmm``: every split made
    new nodes, and inductor's incremental fake-tensor update after the passes
    re-propagates every node downstream of a new one (its comparison asks for the
    old value's storage, which a recomputed value never has). In the training
    step that is nearly the whole graph. Splitting the re-traced graph before
    inductor (:func:`_compile_inductor_direct`) and holding inductor's merge back
    (its check ``should_prefer_unfused_addmm`` answers yes for CPU tensors, so the
    merge pattern declines) leaves the post-grad pass nothing to split, and that
    update nothing to do. The post-grad pass still splits whatever ``addmm`` is
    left (graphs that come through AOTAutograd, a torch without that check).
    """
    if not early_addmm_split():
        return contextlib.nullcontext()
    return _merge_hold()


def _post_grad_pass():
    """petfunc's graph pass for inductor's ``post_grad_custom_post_pass``
    (:func:`_unfuse_addmm`), run after inductor's own. Inductor puts a custom
    pass's ``uuid()`` into the key of its FX-graph cache, and sees petfunc's
    code-generation hooks no other way: without it, a graph compiled by an
    earlier petfunc (for instance before the summation fix above) would be
    loaded from the cache with its old kernels."""
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class PetfuncPostGrad(CustomGraphPass):
        def __call__(self, graph):
            _unfuse_addmm(graph)

        def uuid(self):
            return "petfunc-codegen-" + _codegen_hash()

    return PetfuncPostGrad()


def fusion_pair_attempts() -> int:
    """How many later nodes of one buffer's readers inductor's scheduler tries to
    fuse each node with (its ``max_fusion_buffer_group_pairwise_attempts``, 64 as
    shipped); petfunc's default is 16, ``PETFUNC_FUSION_PAIR_ATTEMPTS`` sets it.

    A node is tried against the next ones among the readers and writers of each
    buffer it uses. In a training step compiled with a packed state
    (:func:`petfunc.init_state`), every node that reads a parameter reads the one
    parameter buffer: 268 nodes in the benchmarks' carbon step, 150 in qm9's, so
    some 17 000 candidate pairs, nearly all of them nodes on unrelated slices.
    With 16 the generated code of both steps is the same, byte for byte, and the
    carbon step's fusion takes 2.4 s instead of 4.2-4.4 s. Applied to graphs on the
    CPU only (the only device it was measured on); a user's own setting in
    ``options`` takes precedence."""
    return int(os.environ.get("PETFUNC_FUSION_PAIR_ATTEMPTS", "16"))


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


def _compile_inductor_direct(graph: torch.fx.GraphModule, mode, fakes):
    """Compile an aten graph with inductor as torch.compile would, minus AOTAutograd.

    Given a graph from Dynamo, inductor's backend first has AOTAutograd trace it
    twice more (once to collect metadata, once to functionalize it and apply
    inductor's decompositions). Here the graph is already a flat aten graph with
    no autograd left in it, so one re-trace, functionalized and decomposed with
    the same table, gives what inductor's inference compiler
    (``compile_fx_forward``: joint-graph passes, then ``compile_fx_inner`` with its
    FX-graph cache) expects, the graph AOTAutograd would hand over. That saves
    5-15 s of a 50-90 s cold compile of a training step. A warm start pays the re-trace
    (4-12 s for PET's training step or forces), where AOTAutograd's own cache
    would load the compiled code without any.

    Returns a callable on the graph's inputs, or None (this torch lacks those entry
    points, or inductor's config asks for freezing or the C++ wrapper, whose
    AOTAutograd path differs): then the caller uses the backend as usual.
    """
    from torch._dispatch.python import enable_python_dispatcher
    from torch._guards import TracingContext, tracing

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
        if early_addmm_split():
            # see hold_cpu_addmm_merge: split now, so that inductor's passes change nothing here
            _unfuse_addmm(functional.graph)
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


def _innermost(error: BaseException) -> BaseException:
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


def _cpp_vector_codegen_failed(error: BaseException) -> bool:
    """Whether ``error`` is an assertion of inductor's C++ code generator.

    torch 2.11 and 2.13 (not 2.14) assert, while writing a vectorized
    ``atomic_add``, that the index is a vector: a scatter into a buffer of one
    element (for instance a per-atom sum of a lone one-atom cell, a size torch
    specialises) has a constant index there. Such a graph compiles with scalar
    kernels. Only assertions raised in ``codegen/cpp.py`` count: any other
    failure is the caller's to see.
    """
    inner = _innermost(error)
    if not isinstance(inner, AssertionError) or inner.__traceback__ is None:
        return False
    frame = inner.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    return Path(frame.tb_frame.f_code.co_filename).as_posix().endswith("_inductor/codegen/cpp.py")


def _cache_file(key: str, signature) -> Path | None:
    folder = trace_cache_dir()
    if folder is None:
        return None
    text = repr((key, _source_hash(), torch.__version__, signature))
    return folder / (hashlib.sha256(text.encode()).hexdigest()[:32] + ".fx.pkl")


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


def _specialised_size(size, shape_env) -> int | None:
    """The number a fake input's size stands for, if it is one after compiling: a
    plain int, or a symbol the shape environment replaced by a number; else None."""
    if not isinstance(size, torch.SymInt):
        return int(size)
    expr = shape_env.replace(size.node.expr)
    return int(expr) if expr.is_number else None


def _load_trace(path: Path):
    """``(graph, output spec, output layout, trace guards)`` from a cache file, or
    ``None`` (missing or unreadable)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        # a graph's code is re-run by torch.fx on load; it may name this lazily
        # imported module (torch 2.13)
        import torch._higher_order_ops.triton_kernel_wrap  # noqa: F401
    except ImportError:
        pass
    try:
        with warnings.catch_warnings():
            # unpickling a TreeSpec warns about its own deprecated LeafSpec check (torch 2.13)
            warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
            state, out_spec, out_layout, guards = pickle.loads(data)
        if not isinstance(state, dict) or not isinstance(out_layout, _Layout):
            raise TypeError(f"holds a {type(state).__name__} and a {type(out_layout).__name__}")
        graph = _graph_from_state(state)
        if not isinstance(guards, list) or not all(isinstance(g, str) for g in guards):
            raise TypeError("its trace guards are not a list of strings")
        return graph, out_spec, out_layout, guards
    except Exception as error:  # a damaged or foreign file: trace again
        warnings.warn(
            f"petfunc.compile: ignoring the unreadable trace cache file {path} ({error})", stacklevel=3
        )
        return None


def _save_trace(path: Path, graph, out_spec, out_layout, guards) -> None:
    """Write atomically; a failure to write only costs the next process a trace."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        data = pickle.dumps((_graph_state(graph), out_spec, out_layout, guards))
        atomic_write(path, lambda handle: handle.write(data))
    except Exception as error:
        warnings.warn(f"petfunc.compile: could not write the trace cache file {path} ({error})", stacklevel=3)


# ---------------------------------------------------------------------------------------
# compiled functions


class Compiled:
    """A traced and compiled function with the signature of the original.

    ``from_cache`` tells whether the graph came from the trace cache.
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
            aot_autograd = os.environ.get("PETFUNC_DIRECT_INDUCTOR", "1") == "0"
        self.aot_autograd = bool(aot_autograd)
        tensors, self._constants, self._is_tensor, self._spec = _split(example_args)
        self._fast_in = _fast_tree(self._spec)
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
        self._in_layout = _Layout(
            tensors, _packed_runs(tensors, [s and t.dim() > 0 for t, s in zip(tensors, static)])
        )
        self._static = [True if stop is not None else static[i] for i, stop in self._in_layout.items]
        # donated packed buffers (graph input positions): the graph writes outputs into them
        self._donated_inputs = [
            k for k, (i, stop) in enumerate(self._in_layout.items) if stop is not None and donated[i]
        ]
        self._leaf_signature = [(t.dtype, t.device, t.dim()) for t in tensors]
        self._leaf_static_shapes = [tuple(t.shape) if s else None for t, s in zip(tensors, static)]
        self._run_info = {
            k: _RunInfo(tensors[i:stop])
            for k, (i, stop) in enumerate(self._in_layout.items)
            if stop is not None
        }
        if backend == "inductor" and any(t.device.type == "cpu" for t in tensors):
            # inductor's C++ code generation will need it: probe while make_fx traces
            _cpu_kernels.start_isa_probe()
        self._out_spec = None
        self._out_layout = None

        def flat_fn(*placeholders):
            graph_tensors = [
                t.reshape(()) if stop is None and self._scalar[i] else t
                for t, (i, stop) in zip(placeholders, self._in_layout.items)
            ]
            args = _merge(self._in_layout.unpack(graph_tensors), self._constants, self._is_tensor, self._spec)
            out = fn(*args)
            out_leaves, out_spec = pytree.tree_flatten(out)
            self._out_spec = out_spec
            # outputs packed like the inputs (the new parameters and moments) leave
            # the graph as their whole buffers too; donated inputs take the outputs
            # laid out like them (the new state)
            donation = _donation_runs(out_leaves, self._in_layout, placeholders, self._donated_inputs)
            eligible = [isinstance(t, torch.Tensor) and t.dim() > 0 for t in out_leaves]
            for start, stop, _ in donation:
                eligible[start:stop] = [False] * (stop - start)
            runs = sorted(_packed_runs(out_leaves, eligible) + [(start, stop) for start, stop, _ in donation])
            self._out_layout = _Layout(out_leaves, runs)
            packed = self._out_layout.pack(out_leaves)
            item = {i: k for k, (i, _) in enumerate(self._out_layout.items)}
            self._out_layout.donated = {item[start]: j for start, _, j in donation}
            if donation:
                packed = _donate(packed, self._out_layout.donated, placeholders)
            return tuple(t for k, t in enumerate(packed) if k not in self._out_layout.donated)

        inputs = self._graph_inputs(tensors)
        traced_on = trace_device(inputs)
        if fused_attention is None:
            fused_attention = os.environ.get("PETFUNC_FUSED_ATTENTION", "0") == "1"
        if fused_attention:
            if traced_on is not None or any(t.device.type != "cpu" for t in inputs):
                raise ValueError(
                    "petfunc.compile: fused_attention=True is for functions on the CPU; "
                    "on a GPU the attention is compiled from its decomposition"
                )
            # False (with a warning) where the kernels cannot be built
            fused_attention = _fused.library() is not None
        self.fused_attention = bool(fused_attention)
        cache = None
        if cache_key is not None:
            signature = (
                # a data size of 0 or 1 is fixed in the trace (the shape environment
                # specialises them): an example of one structure traces another graph
                # than a batch (loading it for a batch failed its size guards)
                [
                    (
                        t.dtype,
                        str(t.device),
                        tuple(t.shape) if s else tuple(n if n < 2 else -1 for n in t.shape),
                    )
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
            cache = _cache_file(str(cache_key), signature)
        loaded = _load_trace(cache) if cache is not None and cache.exists() else None
        self.from_cache = loaded is not None
        if loaded is not None:
            self.graph, self._out_spec, self._out_layout, trace_guards = loaded
        else:
            mode, fakes = _fake_inputs(inputs, self._static, traced_on)
            # vmap's symbolic-size rules for the whole trace: a vmap inside a grad (a
            # Hessian-vector loss, an ensemble) is replayed by the backward of that grad,
            # after the vmap's own block has exited (torch 2.12's C++ rule of bmm
            # then read the sizes as integers and fixed the atom count)
            with fft_meta(), symbolic_vmap_rules(), _fused.use(self.fused_attention), mode, torch.no_grad():
                self.graph = make_fx(flat_fn, tracing_mode="real")(*fakes)
            if traced_on is not None:
                _move_graph(self.graph, traced_on, inputs[0].device)
            trace_guards = _shape_guards(mode.shape_env, fakes, self._static)
            # forward-mode AD (jvp) leaves unused checks such as aten.is_same_size, which
            # return Python bools that Dynamo cannot put in a graph: drop dead nodes
            self.graph.graph.eliminate_dead_code()
            _drop_unused_constants(self.graph)
            self.graph.recompile()
            if cache is not None:
                _save_trace(cache, self.graph, self._out_spec, self._out_layout, trace_guards)
                # compile the graph as later processes will load it: its inductor
                # cache entry then serves them (a freshly traced graph hashes
                # differently from its reloaded copy)
                reloaded = _load_trace(cache)
                if reloaded is not None:
                    self.graph = reloaded[0]
        self._set_trace_guards(trace_guards, example_args)
        self._fast_out = _fast_tree(self._out_spec)
        self.num_graphs = 0
        self.options = dict(options or {})
        self._entries = []  # (guard code or None, fixed data sizes, compiled callable)

    def _set_trace_guards(self, guards, example_args):
        """Keep the size relations the trace assumed, checked at every call.

        They are equalities between data sizes, or of a data size and a number.
        For a well-formed batch they hold by construction (an edge array is as long
        as its partner array, positions have 3 columns). Any other constant means
        that some op read a size as a plain integer and the graph is valid for
        that size only (torch 2.11's batching rule of ``mm``, for one, did so).
        Without this check such a graph would silently compute garbage for any
        other size; with it, the call fails and says which assumption broke.
        """
        self._trace_guards = list(guards)
        joined = " and ".join(f"({g})" for g in guards)
        self._trace_guard_code = (
            builtins.compile(joined, "<petfunc trace guards>", "eval") if guards else None
        )
        # readable names of the graph inputs, for the error message
        paths = [
            pytree.keystr(path)
            for path, leaf in pytree.tree_flatten_with_path(tuple(example_args))[0]
            if isinstance(leaf, torch.Tensor)
        ]
        self._input_names = [
            f"args{paths[i]}"
            if stop is None
            else f"the packed buffer of args{paths[i]} ... args{paths[stop - 1]}"
            for i, stop in self._in_layout.items
        ]

    def _check_trace_guards(self, inputs):
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        if self._trace_guard_code is None:
            return
        scope = {"L": {f"t{i}": t for i, t in enumerate(inputs)}}
        if eval(self._trace_guard_code, SYMPY_INTERP, scope):
            return
        broken = [g for g in self._trace_guards if not eval(g, SYMPY_INTERP, scope)]

        def readable(text):
            return re.sub(r"L\['t(\d+)'\]", lambda m: self._input_names[int(m.group(1))], text)

        raise ValueError(
            "compiled function: the input sizes break what the traced graph assumed: "
            + "; ".join(readable(g) for g in broken)
            + ". A batch from petfunc.make_batch satisfies these relations; if yours "
            "does and a size was fixed to a number here, the trace specialised on the "
            "example's size (a torch op read it as an integer)"
        )

    def _call_inputs(self, tensors):
        """The graph's inputs for the tensor leaves ``tensors``, checked.

        A packed run whose leaves are still consecutive, contiguous views of one
        buffer with the traced shapes is passed as that buffer after one pass of
        cheap checks (4 attribute reads a leaf instead of 8; a qm9 training state
        has 3 runs of 115 leaves). Anything else takes the full checks (and their
        error messages) and is copied into a buffer. Also returns
        ``{graph input: the run's leaves}`` for the runs passed without a copy.
        """
        inputs, views = [], {}
        for k, (i, stop) in enumerate(self._in_layout.items):
            if stop is not None:
                buffer = _run_buffer(tensors[i:stop], self._run_info[k])
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
        """The graph's inputs for ``tensors`` (:meth:`_call_inputs` without the views)."""
        return self._call_inputs(tensors)[0]

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
        mode, fakes = _fake_inputs(inputs, self._static)
        inner = torch._dynamo.lookup_backend(self.backend) if isinstance(self.backend, str) else self.backend
        options = dict(self.options)
        if torch._inductor.config.post_grad_custom_post_pass is None:
            options.setdefault("post_grad_custom_post_pass", _post_grad_pass())
        on_cpu = all(t.device.type == "cpu" for t in inputs if isinstance(t, torch.Tensor))
        if on_cpu and hasattr(torch._inductor.config, "max_fusion_buffer_group_pairwise_attempts"):
            # measured on CPU only; GPU graphs keep inductor's setting
            options.setdefault("max_fusion_buffer_group_pairwise_attempts", fusion_pair_attempts())
        if not on_cpu and hasattr(torch._inductor.config.triton, "coalesce_tiling_analysis"):
            # Triton kernels: inductor's memory-coalescing analysis of tilings (meant for
            # static shapes, says its config) failed an assertion on the symbolic sizes
            # of PET's carbon training step (torch 2.11, H200: get_pw_red_splits in
            # tiling_utils). Off, that step compiled and ran 3.95x faster than metatrain
            options.setdefault("triton.coalesce_tiling_analysis", False)
        direct = self.backend == "inductor" and not self.aot_autograd
        _cpu_kernels.wait_isa_probe()

        def build(options):
            with (
                torch._inductor.config.patch(options),
                no_duck_shape(),
                torch.no_grad(),
                _cpu_kernels.grouped(),
                unguarded_sum_helper(),
                fft_meta(),
                _vec_strides.fast_strides(),
                hold_cpu_addmm_merge(),
                _cpu_kernels.optimization_level(),
            ):
                compiled = _compile_inductor_direct(self.graph, mode, fakes) if direct else None
                return inner(self.graph, fakes) if compiled is None else compiled

        try:
            compiled = build(options)
        except Exception as error:
            if not (on_cpu and self.backend == "inductor" and _cpp_vector_codegen_failed(error)):
                raise
            warnings.warn(
                f"inductor failed to vectorize a CPU kernel of this graph ({_innermost(error)!r}); "
                "compiling it again without vectorized kernels (cpp.simdlen=1): right, but slower",
                stacklevel=4,
            )
            compiled = build({**options, "cpp.simdlen": 1})
        # symbolic sizes: the relations the backend assumed; data sizes torch
        # specialised are fixed numbers, checked one by one (parameter shapes are
        # checked by _check_inputs). Those are the sizes made plain numbers (0 or 1)
        # and the symbols the backend set equal to a number while compiling: the
        # guard expression leaves both out (it takes static sizes as checked), and
        # a graph specialised to a size of 2 then ran for every size, wrongly
        guards = mode.shape_env.produce_guards_expression(fakes)
        code = None if guards is None else builtins.compile(guards, "<petfunc guards>", "eval")
        fixed = [
            (index, dim, value)
            for index, (fake, static) in enumerate(zip(fakes, self._static))
            if not static
            for dim, size in enumerate(fake.shape)
            if (value := _specialised_size(size, mode.shape_env)) is not None
        ]
        self._entries.append((code, fixed, compiled))
        self.num_graphs += 1
        return compiled

    def _select(self, inputs):
        from torch.fx.experimental.symbolic_shapes import SYMPY_INTERP

        names = {f"t{i}": t for i, t in enumerate(inputs)}
        for code, fixed, compiled in reversed(self._entries):
            if all(inputs[i].shape[d] == size for i, d, size in fixed) and (
                code is None or eval(code, SYMPY_INTERP, {"L": names})
            ):
                return compiled
        return self._compile_for(inputs)

    def __call__(self, *args):
        tensors = self._checked_tensors(args)
        inputs, views = self._call_inputs(tensors)
        self._check_trace_guards(inputs)
        donated = self._out_layout.donated
        if donated:
            given = inputs
            inputs = self._distinct_donations(inputs)
            # a donated run that came in as views of its buffer leaves as those same
            # views (the buffer now holds the new values; _donation_runs paired it
            # with an output run of the same shapes): no new view objects. Not for a
            # buffer _distinct_donations copied: the views do not show that one
            views = {k: views[j] for k, j in donated.items() if j in views and inputs[j] is given[j]}
        with torch.no_grad():
            out = self._select(inputs)(*inputs)
        if donated:
            out = _with_donated(out, donated, inputs, len(self._out_layout.items))
            leaves = self._out_layout.unpack_views(out, views)
        else:
            leaves = self._out_layout.unpack_views(out)
        if self._fast_out is not None:
            return self._fast_out.unflatten(leaves)
        return pytree.tree_unflatten(leaves, self._out_spec)

    def _checked_tensors(self, args):
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

    def eager_graph(self, *args):
        """Run the traced (uncompiled) graph: the reference for compiled == traced."""
        tensors, *_ = _split(args)
        inputs = self._graph_inputs(tensors)
        self._check_trace_guards(inputs)
        donated = self._out_layout.donated
        if donated:
            inputs = self._distinct_donations(inputs)
        with torch.no_grad():
            out = self.graph(*inputs)
        if donated:
            out = _with_donated(out, donated, inputs, len(self._out_layout.items))
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


def has_p3m_inputs(args) -> bool:
    """Whether ``args`` hold the long-range inputs of a P3M batch with a mesh."""
    from petfunc.graph.long_range import mesh_layout
    from petfunc.graph.neighbors import Neighbors

    def is_neighbors(x):
        return isinstance(x, Neighbors)

    return any(
        any(mesh_layout(x.long_range) or ())
        for x in pytree.tree_leaves(args, is_leaf=is_neighbors)
        if is_neighbors(x)
    )


def compile(
    fn: Callable,
    *example_args,
    backend: Any = "inductor",
    options: dict | None = None,
    static_argnums=(0,),
    cache_key: str | None = None,
    keep_freed_memory: bool = True,
    aot_autograd: bool | None = None,
    donate_argnums=(),
    fused_attention: bool | None = None,
) -> Compiled:
    """Trace ``fn(*example_args)`` with ``make_fx`` and compile it (see module doc).

    Args:
        fn: a pure function of pytrees of tensors.
        example_args: arguments to trace with. Every size of every tensor must be at
            least 2 (build batches with :func:`petfunc.data.make_batch`, which pads).
        backend: ``torch.compile`` backend: ``"inductor"`` (fast code, slow to
            compile) or ``"aot_eager"`` (quick to compile, for tests).
        options: inductor config options (``torch._inductor.config`` names), set
            while the graph compiles.
        static_argnums: arguments whose tensor sizes never change (parameters,
            optimizer state): they are traced with static sizes, which makes tracing
            and compiling much faster. All other tensors get symbolic sizes.
        cache_key: keep the trace in the trace cache under this key (see the module
            docstring); it must identify everything ``fn`` bakes into the trace.
        keep_freed_memory: when a tensor input is on the CPU, call
            :func:`petfunc.allocator.keep_freed_memory` (process-wide). A packed
            train state leaves the graph as a few model-sized buffers at every call;
            with glibc's defaults those are returned to the system when freed and
            page-faulted in again at the next step, which made the compiled qm9
            step 7 % slower than a step on separate tensors, instead of 4 % faster.
        aot_autograd: with inductor, compile through AOTAutograd as torch.compile
            does (its two re-traces of the graph; its cache makes a warm start a
            few seconds shorter) instead of one functionalizing re-trace (a cold
            compile 5-15 s shorter). Default: False, unless the environment sets
            ``PETFUNC_DIRECT_INDUCTOR=0``. The ASE calculators pass True: they are
            mostly started warm.
        donate_argnums: arguments (among ``static_argnums``) whose packed buffers
            the compiled function may overwrite with its outputs, as JAX's option
            of that name: a train step given ``donate_argnums=(0,)`` updates the
            parameters and optimizer moments of a state made by
            :func:`petfunc.init_state` in place, and the new state's tensors are
            views of the old state's buffers. The caller must not use the donated
            arguments after the call (they hold the new values, or a mix).
            ``petfunc train`` donates its state. Saves the Adam update a third of
            its memory traffic and the new state's memory.
        fused_attention: trace PET's attention as the CPU kernels of
            :mod:`petfunc.ops.fused_attention` (no ``[atoms, heads, t, t]`` grids in
            memory). Default: off, or on where the environment sets
            ``PETFUNC_FUSED_ATTENTION=1``. CPU inputs only.

    Returns:
        a callable with ``fn``'s signature; ``.num_graphs`` counts compilations.
    """
    from petfunc.model import long_range

    devices = {x.device for x in pytree.tree_leaves(example_args) if isinstance(x, torch.Tensor)}
    if (
        backend == "inductor"
        and not all(long_range.p3m_inductor_correct(d) for d in devices)
        and has_p3m_inputs(example_args)
    ):
        raise ValueError(
            "inductor of torch < 2.13 is not known to compile the derivative of P3M "
            "long-range features with respect to the cell right on a GPU (torch 2.11 "
            "miscompiled it: strain derivatives, hence stresses, wrong by 100 %; avoided "
            "since, but checked on the CPU only): use backend='aot_eager', Ewald inputs "
            "(from_atoms(..., long_range='ewald')), the CPU, or torch >= 2.13"
        )
    if keep_freed_memory and any(
        isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in pytree.tree_leaves(example_args)
    ):
        from petfunc.allocator import keep_freed_memory as keep

        keep()
    return Compiled(
        fn,
        example_args,
        backend=backend,
        options=options,
        static_argnums=static_argnums,
        cache_key=cache_key,
        aot_autograd=aot_autograd,
        donate_argnums=donate_argnums,
        fused_attention=fused_attention,
    )
