"""Compile inductor's C++ kernels of one graph a few translation units at a time.

Inductor builds every C++ kernel of a CPU graph as its own shared library: one
``g++`` run per kernel. Each run loads the precompiled ATen header (large) and links
before it compiles the kernel itself (typically quick), so the fixed cost
dominates. PET's training step has about a hundred to a few hundred kernels: most
of a cold compile is spent loading the same header over and over.

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

A cold compile of PET's training step from an empty cache is a third shorter
(``benchmarks/cold_compile.py --variants separate grouped``, see docs/performance.md).
``PETFUNC_GROUP_KERNELS=0`` (or ``PETFUNC_PATCHES_OFF=kernel_groups``) turns this off.
"""

from __future__ import annotations

import ast
import functools
import re
import sys
import warnings
from concurrent.futures import ThreadPoolExecutor

from petfunc._torch import versions
from petfunc._torch.patch import SPEED, Patch


_KERNEL = re.compile(r'^extern\s+"C"\s+void\s+kernel\s*\(', re.M)
# a C++ kernel as inductor's code generation defines it for the Python wrapper
_DEFINITION = re.compile(r"\Aasync_compile\.cpp_pybinding\((\[.*?\]), r'''(.*)'''\)\s*\Z", re.S)
#: a group is closed once its kernels hold this many characters of source (the
#: training step's kernels: about 0.4 MB (energy only) to 1.4 MB (with forces and
#: stress); a group builds in a few seconds)
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
    if (value == reinterpret_cast<void*>(-1) && PyErr_Occurred())
        throw std::runtime_error("expected an int argument");
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
def code_cache():
    from torch._inductor.codecache import CppPythonBindingsCodeCache

    class GroupedBindingsCache(CppPythonBindingsCodeCache):
        """Inductor's cache of Python-bound C++ libraries (same flags, header and
        loading), for sources that hold several kernels."""

        cache: dict = {}

    return GroupedBindingsCache


class Pending:
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
                    build(self.owner)
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


def groups(kernels):
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
    from torch._inductor.async_compile import get_compile_threads

    return ThreadPoolExecutor(max_workers=max(1, get_compile_threads()), thread_name_prefix="petfunc-g++")


def start(group):
    """Start building one group; returns ``{(argtypes, source): loader}``, where a
    loader returns the kernel's entry point (waiting for the build)."""
    load = code_cache().load_async(
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


defined = []  # kernels of the graph being generated, not yet in a started group
started = {}  # (argtypes, source) -> loader, for groups started during code generation


def on_definition(body: str) -> None:
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
    defined.append(_Defined(argtypes, source))
    closed, _ = groups(defined)
    if closed:
        del defined[:]
        try:
            started.update(start(closed[0]))
        except Exception:  # noqa: BLE001 - these kernels are built when the module loads
            pass


def build(owner):
    """Build the pending kernels of one compiled module (an ``AsyncCompile``):
    those whose group started during code generation get its loader; the others
    are cut into groups (the same groups, for a module from inductor's cache) and
    built now."""
    pending = owner.__dict__.pop("_petfunc_pending", [])
    del defined[:]  # code generation of this module is over
    if not pending:
        return
    rest = []
    for p in pending:
        loader = started.pop((tuple(p.argtypes), p.source), None)
        if loader is not None:
            p._load = loader
        else:
            rest.append(p)
    closed, last = groups(rest)
    try:
        for group in closed + ([last] if last else []):
            loaders = start(group)
            for p in group:
                p._load = loaders[(tuple(p.argtypes), p.source)]
    except Exception as error:  # noqa: BLE001 - these kernels fall back one by one
        for p in rest:
            if p._load is None:
                p._error = error


def _targets():
    from torch._inductor.async_compile import AsyncCompile
    from torch._inductor.codegen.wrapper import PythonWrapperCodegen

    return [
        (AsyncCompile, "cpp_pybinding"),
        (AsyncCompile, "wait"),
        (PythonWrapperCodegen, "define_kernel"),
    ]


def _install():
    """Route inductor's C++ kernels through the groups; returns what to restore."""
    targets = _targets()
    originals = [getattr(owner, name) for owner, name in targets]
    original_pybinding, original_wait, original_define = originals

    def cpp_pybinding(self, argtypes, source_code):
        if not groupable(argtypes, source_code):
            return original_pybinding(self, argtypes, source_code)
        kernel = Pending(self, list(argtypes), source_code, original_pybinding)
        self.__dict__.setdefault("_petfunc_pending", []).append(kernel)
        return kernel

    def wait(self, scope):
        build(self)
        for key, value in list(scope.items()):
            if isinstance(value, Pending):
                scope[key] = value.result()
        return original_wait(self, scope)

    def define_kernel(self, kernel_name, kernel_body, *args, **kwargs):
        if isinstance(kernel_body, str):
            on_definition(kernel_body)
        return original_define(self, kernel_name, kernel_body, *args, **kwargs)

    for (owner, name), value in zip(targets, (cpp_pybinding, wait, define_kernel)):
        setattr(owner, name, value)
    return list(zip(targets, originals))


def _uninstall(saved):
    for (owner, name), original in saved:
        setattr(owner, name, original)
    del defined[:]


# WORKAROUND(torch<2.15): inductor builds every C++ kernel as a library of its own,
# each g++ run loading the same precompiled header. Remove when inductor builds a
# graph's CPU kernels in a few translation units.
KERNEL_GROUPS = Patch(
    "kernel_groups",
    purpose=SPEED,
    needed=versions.INDUCTOR_SPEED_PATCHES,
    summary="inductor's C++ kernels built a few per library, starting during code generation",
    module=sys.modules[__name__],
    install=_install,
    uninstall=_uninstall,
    targets=_targets,
)


def grouped():
    """While active, inductor's C++ kernels are built in groups (module docstring):
    the patch :data:`KERNEL_GROUPS` held for a ``with`` block."""
    return KERNEL_GROUPS.scope()
