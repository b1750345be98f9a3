"""Compile inductor's C++ kernels of one graph a few translation units at a time.

Inductor builds every C++ kernel of a CPU graph as its own shared library: one
``g++`` run per kernel. Each run loads the precompiled ATen header (about 150 MB,
0.4 s) and links (0.2 s) before it compiles the kernel itself (typically 0.1-0.5 s),
so the fixed cost dominates. PET's training step has 75 kernels (energy only) to
about 200 (with forces and stress): most of a cold compile was spent loading the
same header over and over.

:func:`grouped` batches them: while it is active, the kernels are cut, in the
order inductor defines them, into consecutive groups of about
:data:`GROUP_CHARS` characters of source, each built once into one Python extension
with one entry point per kernel. A group starts building (``compile_threads``
at a time) as soon as inductor's code generation has defined its kernels, so
``g++`` runs while the rest of the graph is still being generated (code generation
is single-threaded Python); when the compiled module loads, its kernels
(``AsyncCompile.cpp_pybinding``) find their group already built or building, and
the last, partial group is built then. A module loaded from inductor's cache, with
no code generation, cuts the same groups from its kernels and finds them in the
cache. The kernels' code is unchanged (same flags, same precompiled header,
arguments converted as inductor's own bindings convert them), only renamed
(``kernel`` -> ``kernel_<i>``); the libraries live in inductor's cache, keyed by
their source, so a warm start rebuilds nothing. A kernel whose source does not have
the expected shape (one ``extern "C" void kernel(...)`` and nothing else at file
scope) is left to inductor, and so is every kernel of a group that fails to build or
load (with a warning).

Measured on the default PET's training step (``benchmarks/cold_compile.py``), cold
compile from an empty cache: qm9 116 -> 80 s, carbon 158 -> 118 s with groups built
after code generation; starting them during code generation then took carbon from
118.6 to 107.4 s (qm9 unchanged).
``PETFUNC_GROUP_KERNELS=0`` turns this off.

:func:`start_isa_probe` runs inductor's probe of the CPU's vector instruction sets
(one test program built and loaded per instruction set, about 8 s on this
project's CPU when inductor's cache is empty) in a background thread, while
``make_fx`` traces; :func:`wait_isa_probe` joins it before inductor needs it.
"""

from __future__ import annotations

import ast
import contextlib
import functools
import os
import re
import threading
import warnings

from petfunc._torch.patch import Scoped, scoped_attribute


_KERNEL = re.compile(r'^extern\s+"C"\s+void\s+kernel\s*\(', re.M)
# a C++ kernel as inductor's code generation defines it for the Python wrapper
_DEFINITION = re.compile(r"\Aasync_compile\.cpp_pybinding\((\[.*?\]), r'''(.*)'''\)\s*\Z", re.S)
#: a group is closed once its kernels hold this many characters of source (the
#: training step's kernels: about 0.4 MB (energy only) to 1.4 MB (with forces and
#: stress); a group of 150 kB builds in about 5 s on this project's CPU)
GROUP_CHARS = 150_000
_SCALARS = {"int64_t", "uintptr_t", "float", "double"}


def _argument_type(argtype: str):
    """The C++ type ``parse_arg`` converts to, or None if we cannot convert it."""
    t = argtype.replace("const ", "").strip()
    return t if t.endswith("*") or t in _SCALARS else None


def groupable(argtypes, source: str) -> bool:
    """True if ``source`` defines one ``extern "C" void kernel(...)`` and nothing
    else at file scope besides ``#include`` lines."""
    if any(_argument_type(a) is None for a in argtypes) or len(_KERNEL.findall(source)) != 1:
        return False
    for line in source.splitlines():
        if line[:1] in ("", " ", "\t", "{", "}") or line.startswith(("#include", "//")):
            continue
        if not _KERNEL.match(line):
            return False
    return True


_BINDINGS_HEAD = r"""
// petfunc: Python entry points of the kernels above, one per kernel
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <type_traits>

// torch's tensor -> data pointer function, found through an environment variable
// that torch sets before loading the library (as for its own kernels)
static void* (*petfunc_data_ptr)(PyObject*);

template <typename T> static inline T petfunc_arg(PyObject* args, Py_ssize_t i) {
    static_assert(std::is_pointer_v<T>, "tensor (pointer) or scalar arguments only");
    return static_cast<T>(petfunc_data_ptr(PyTuple_GET_ITEM(args, i)));
}
template <> inline int64_t petfunc_arg<int64_t>(PyObject* args, Py_ssize_t i) {
    Py_ssize_t value = PyLong_AsSsize_t(PyTuple_GET_ITEM(args, i));
    if (value == -1 && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return value;
}
template <> inline uintptr_t petfunc_arg<uintptr_t>(PyObject* args, Py_ssize_t i) {
    void* value = PyLong_AsVoidPtr(PyTuple_GET_ITEM(args, i));
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred()) throw std::runtime_error("expected an int argument");
    return reinterpret_cast<uintptr_t>(value);
}
template <> inline double petfunc_arg<double>(PyObject* args, Py_ssize_t i) {
    double value = PyFloat_AsDouble(PyTuple_GET_ITEM(args, i));
    if (value == -1.0 && PyErr_Occurred()) throw std::runtime_error("expected a float argument");
    return value;
}
template <> inline float petfunc_arg<float>(PyObject* args, Py_ssize_t i) {
    return static_cast<float>(petfunc_arg<double>(args, i));
}
"""

_BINDING = r"""
static PyObject* petfunc_call_{i}(PyObject* self, PyObject* args) {{
    try {{
        if (!PyTuple_CheckExact(args) || PyTuple_GET_SIZE(args) != {n})
            throw std::runtime_error("kernel_{i} takes a tuple of {n} arguments");
        kernel_{i}({args});
        Py_RETURN_NONE;
    }} catch (std::exception const& e) {{
        PyErr_SetString(PyExc_RuntimeError, e.what());
        return nullptr;
    }} catch (...) {{
        PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception in kernel_{i}");
        return nullptr;
    }}
}}
"""

_BINDINGS_TAIL = r"""
static PyMethodDef petfunc_methods[] = {{
{methods}
    {{nullptr, nullptr, 0, nullptr}}}};

static struct PyModuleDef petfunc_module = {{PyModuleDef_HEAD_INIT, "kernel", nullptr, -1, petfunc_methods}};

PyMODINIT_FUNC PyInit_kernel(void) {{
    const char* address = std::getenv("_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
    if (!address) {{
        PyErr_SetString(PyExc_RuntimeError, "_TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR is not set");
        return nullptr;
    }}
    char* end = nullptr;
    errno = 0;
    uintptr_t value = std::strtoull(address, &end, 10);
    if (errno != 0 || end == address || value == 0) {{
        PyErr_SetString(PyExc_RuntimeError, "cannot parse _TORCHINDUCTOR_PYOBJECT_TENSOR_DATA_PTR");
        return nullptr;
    }}
    petfunc_data_ptr = reinterpret_cast<decltype(petfunc_data_ptr)>(value);
    return PyModule_Create(&petfunc_module);
}}
"""


def group_source(kernels) -> str:
    """One C++ source for ``kernels`` (a list of ``(argtypes, source)``): the
    kernels renamed ``kernel_<i>``, then a Python module ``kernel`` whose
    function ``kernel_<i>`` calls kernel i with its arguments converted as
    inductor's own bindings do."""
    parts, bindings, methods = [], [], []
    for i, (argtypes, source) in enumerate(kernels):
        parts.append(_KERNEL.sub(f'extern "C" void kernel_{i}(', source, count=1))
        args = ", ".join(f"petfunc_arg<{_argument_type(a)}>(args, {k})" for k, a in enumerate(argtypes))
        bindings.append(_BINDING.format(i=i, n=len(argtypes), args=args))
        methods.append(f'    {{"kernel_{i}", petfunc_call_{i}, METH_VARARGS, ""}},')
    return (
        "\n".join(parts)
        + _BINDINGS_HEAD
        + "".join(bindings)
        + _BINDINGS_TAIL.format(methods="\n".join(methods))
    )


@functools.cache
def _code_cache():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    class GroupedBindingsCache(CppPythonBindingsCodeCache):
        """Inductor's cache of Python-bound C++ libraries (same flags, header and
        loading), for sources that hold several kernels."""

        cache: dict = {}

    return GroupedBindingsCache


class _Pending:
    """A kernel waiting for its group to be built; callable like the kernel.

    If its group cannot be built or loaded (a torch version whose internals
    differ, a compiler error), the kernel is built alone as inductor would have
    built it, with a warning: slower to compile, never wrong.
    """

    def __init__(self, owner, argtypes, source, alone):
        self.owner, self.argtypes, self.source = owner, argtypes, source
        self._alone = alone  # inductor's own cpp_pybinding, unpatched
        self._load = None
        self._error = None  # why its group could not be set up
        self._kernel = None

    def result(self, timeout=None):
        if self._kernel is None:
            try:
                if self._load is None and self._error is None:
                    _build(self.owner)
                if self._error is not None:
                    raise self._error
                self._kernel = self._load()
            except Exception as error:  # noqa: BLE001 - any failure: inductor's path
                warnings.warn(
                    f"petfunc: building inductor's C++ kernels in groups failed ({error!r}); "
                    "building this one alone",
                    RuntimeWarning,
                    stacklevel=2,
                )
                kernel = self._alone(self.owner, self.argtypes, self.source)
                self._kernel = kernel.result() if hasattr(kernel, "result") else kernel
        return self._kernel

    def __call__(self, *args):
        return self.result()(*args)


def _groups(kernels):
    """Consecutive groups of ``kernels`` (items with a ``source``), each closed once
    it holds :data:`GROUP_CHARS` characters; the last one may be smaller. The same
    kernels in the same order always give the same groups, so that the groups
    started during code generation, the groups of a module loaded from inductor's
    cache and the groups in the library cache agree."""
    groups, current, size = [], [], 0
    for kernel in kernels:
        current.append(kernel)
        size += len(kernel.source)
        if size >= GROUP_CHARS:
            groups.append(current)
            current, size = [], 0
    return groups, current


@functools.lru_cache(maxsize=1)
def _builders():
    """Threads that run the group builds (``g++`` runs in subprocesses, so the
    code generation goes on meanwhile): ``compile_threads`` of them."""
    from concurrent.futures import ThreadPoolExecutor

    from torch._inductor.async_compile import get_compile_threads

    return ThreadPoolExecutor(max_workers=max(1, get_compile_threads()), thread_name_prefix="petfunc-g++")


def _start(group):
    """Start building one group; returns ``{(argtypes, source): loader}``, where a
    loader returns the kernel's entry point (waiting for the build)."""
    load = _code_cache().load_async(
        group_source([(k.argtypes, k.source) for k in group]), "cpu", submit_fn=_builders().submit
    )
    return {
        (tuple(k.argtypes), k.source): (lambda name=f"kernel_{i}": getattr(load(), name))
        for i, k in enumerate(group)
    }


class _Defined:
    """A kernel seen during code generation, before its module exists."""

    def __init__(self, argtypes, source):
        self.argtypes, self.source = argtypes, source


_defined = []  # kernels of the graph being generated, not yet in a started group
_started = {}  # (argtypes, source) -> loader, for groups started during code generation


def _on_definition(body: str) -> None:
    """Code generation defined a kernel: add it to the open group, and start
    building that group once it is full."""
    match = _DEFINITION.match(body)
    if match is None:
        return
    try:
        argtypes = ast.literal_eval(match.group(1))
    except (ValueError, SyntaxError):
        return
    source = match.group(2)
    if not groupable(argtypes, source):
        return
    _defined.append(_Defined(argtypes, source))
    closed, _ = _groups(_defined)
    if closed:
        del _defined[:]
        try:
            _started.update(_start(closed[0]))
        except Exception:  # noqa: BLE001 - these kernels are built when the module loads
            pass


def _build(owner):
    """Build the pending kernels of one compiled module (an ``AsyncCompile``):
    those whose group started during code generation get its loader; the others
    are cut into groups (the same groups, for a module from inductor's cache) and
    built now."""
    pending = owner.__dict__.pop("_petfunc_pending", [])
    del _defined[:]  # code generation of this module is over
    if not pending:
        return
    rest = []
    for p in pending:
        loader = _started.pop((tuple(p.argtypes), p.source), None)
        if loader is not None:
            p._load = loader
        else:
            rest.append(p)
    closed, last = _groups(rest)
    try:
        for group in closed + ([last] if last else []):
            loaders = _start(group)
            for p in group:
                p._load = loaders[(tuple(p.argtypes), p.source)]
    except Exception as error:  # noqa: BLE001 - these kernels fall back one by one
        for p in rest:
            if p._load is None:
                p._error = error


def _wrapper_class():
    """Inductor's Python wrapper code generator (whose ``define_kernel`` receives
    each C++ kernel's definition), or None."""
    try:
        from torch._inductor.codegen.wrapper import PythonWrapperCodegen
    except ImportError:  # pragma: no cover - other torch versions: no early builds
        return None
    return PythonWrapperCodegen


def _install():
    """Route inductor's C++ kernels through the groups; returns what to restore."""
    from torch._inductor.async_compile import AsyncCompile

    wrapper = _wrapper_class()
    saved = (AsyncCompile.cpp_pybinding, AsyncCompile.wait, wrapper, getattr(wrapper, "define_kernel", None))
    original_pybinding, original_wait, wrapper, original_define = saved

    def cpp_pybinding(self, argtypes, source_code):
        if not groupable(argtypes, source_code):
            return original_pybinding(self, argtypes, source_code)
        kernel = _Pending(self, list(argtypes), source_code, original_pybinding)
        self.__dict__.setdefault("_petfunc_pending", []).append(kernel)
        return kernel

    def wait(self, scope):
        _build(self)
        for key, value in list(scope.items()):
            if isinstance(value, _Pending):
                scope[key] = value.result()
        return original_wait(self, scope)

    AsyncCompile.cpp_pybinding, AsyncCompile.wait = cpp_pybinding, wait
    if original_define is not None:

        def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
            if isinstance(kernel_body, str):
                _on_definition(kernel_body)
            return original_define(self, kernel_name, kernel_body, *args, **kwargs)

        wrapper.define_kernel = define_kernel
    return saved


def _uninstall(saved):
    from torch._inductor.async_compile import AsyncCompile

    AsyncCompile.cpp_pybinding, AsyncCompile.wait, wrapper, original_define = saved
    if original_define is not None:
        wrapper.define_kernel = original_define
    del _defined[:]


_scope = Scoped(_install, _uninstall)


def grouped():
    """While active, inductor's C++ kernels are built in groups (module docstring)."""
    if os.environ.get("PETFUNC_GROUP_KERNELS", "1") == "0":
        return contextlib.nullcontext()
    try:
        import torch._inductor.async_compile  # noqa: F401
    except ImportError:  # pragma: no cover - inductor unavailable
        return contextlib.nullcontext()
    return _scope()


#: inductor's own optimisation level for its C++ kernels
_INDUCTOR_LEVEL = "O3"
_LEVELS = ("O0", "O1", "O2", "O3", "Os", "Og")


def kernel_opt_level() -> str:
    """The ``g++`` optimisation level of inductor's C++ kernels while
    :func:`optimization_level` is active: ``PETFUNC_KERNEL_OPT``, by default
    inductor's own ``O3``.

    Inductor vectorizes its kernels itself (``at::vec``, with
    ``-fno-tree-loop-vectorize``); what ``-O3`` adds over ``-O2`` (loop
    unswitching, peeling, splitting and distribution, predictive commoning,
    larger inlining budgets) costs about a quarter of each ``g++`` run.
    ``PETFUNC_KERNEL_OPT=O2`` trades that for speed: measured on the
    benchmarks' carbon training step, a cold compile about 2 s shorter (fresh
    processes, medians of three: 65.1 against 66.9 s) for a step about 1.5 %
    slower (four interleaved runs in one process: 1.004-1.017x). After about a
    thousand steps ``-O3`` is ahead, hence the default; short jobs (tests, a
    quick fine-tune) may prefer ``O2``.
    """
    level = os.environ.get("PETFUNC_KERNEL_OPT", _INDUCTOR_LEVEL).strip().lstrip("-")
    if level not in _LEVELS:
        raise ValueError(f"PETFUNC_KERNEL_OPT must be one of {', '.join(_LEVELS)}, not {level!r}")
    return level


def _level_flags():
    """The replacement of inductor's optimisation flags that makes its ``-O3`` for
    C++ kernels :func:`kernel_opt_level`, or None (the level is inductor's own, or
    this torch has other internals)."""
    level = kernel_opt_level()
    try:
        from torch._inductor import cpp_builder
    except ImportError:  # pragma: no cover - inductor unavailable
        return None
    original = getattr(cpp_builder, "_get_optimization_cflags", None)
    if original is None or level == _INDUCTOR_LEVEL:
        return None

    @functools.wraps(original)
    def optimization_cflags(*args, **kwargs):
        cflags, ldflags = original(*args, **kwargs)
        # only the kernels' level: the AOT wrapper's own (min_optimize) is left as is
        return [level if flag == _INDUCTOR_LEVEL else flag for flag in cflags], ldflags

    return cpp_builder, "_get_optimization_cflags", optimization_cflags


_level_scope = scoped_attribute(_level_flags)


def optimization_level():
    """A ``with`` block in which inductor builds C++ kernels at
    :func:`kernel_opt_level`. Flags are part of the key of inductor's library
    cache, so kernels built at another level are never mixed up with these."""
    kernel_opt_level()  # a bad setting fails here, before any compile
    return _level_scope()


_probe = None  # the background thread of start_isa_probe, once started


def start_isa_probe() -> None:
    """Start inductor's probe of the vector instruction sets of this CPU
    (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``) in a background thread,
    once per process.

    Inductor asks for it when it generates its first C++ kernel. With an empty
    cache it builds a test program for each candidate instruction set and loads
    each in a fresh Python process: 7-10 s of a cold compile, spent in ``g++`` and
    subprocesses while the compiling thread waits. Started before ``make_fx``
    traces (single-threaded Python), it runs on another core meanwhile. The probe
    caches its answer in the process (``functools.cache``), so inductor then finds
    it done; :func:`wait_isa_probe` must be called before inductor runs, so that
    the two never probe at once. ``PETFUNC_EARLY_ISA_PROBE=0`` turns this off.
    """
    global _probe
    if _probe is not None or os.environ.get("PETFUNC_EARLY_ISA_PROBE", "1") == "0":
        return
    # Every module the probe needs is imported here, in the calling thread. Imported
    # by the probe's thread while the caller imports torch._dynamo (make_fx's shape
    # environment does), torch's circular imports between _dynamo and _inductor
    # meet half-initialised modules: "cannot import name 'IndentedBuffer' from
    # partially initialized module 'torch._inductor.utils'" in the caller, and
    # torch._dynamo left broken for the rest of the process (measured: torch 2.11
    # and 2.13, in most runs of a script that imports torch._dynamo right after).
    import torch._dynamo
    import torch._inductor.codecache
    import torch._inductor.cpp_builder
    import torch.utils._filelock  # noqa: F401
    from torch._inductor import cpu_vec_isa

    def probe():
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - inductor probes again itself and reports
            pass

    _probe = threading.Thread(target=probe, name="petfunc-isa-probe", daemon=True)
    _probe.start()


def wait_isa_probe() -> None:
    """Wait for :func:`start_isa_probe`'s thread, if one was started."""
    if _probe is not None:
        _probe.join()
