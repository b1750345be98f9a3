"""The shared library of the fused attention kernels (``_attention.cpp``,
:mod:`petfunc.ops.fused_attention`): built with the system's C++ compiler (``c++`` or
``$CXX``) at first use, in a few seconds, into inductor's cache folder, keyed by the
source, the compiler and the CPU's instruction sets."""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import subprocess
import tempfile
import warnings
from pathlib import Path


SOURCE = Path(__file__).with_name("_attention.cpp")
_FLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-fopenmp", "-shared", "-fPIC", "-std=c++17"]


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return ""


def _compiler() -> str:
    return os.environ.get("CXX", "c++")


@functools.lru_cache(maxsize=1)
def library() -> ctypes.CDLL | None:
    """The kernels' shared library (built at first use), or None where it cannot
    be built (no compiler, not x86/Linux): the decomposed attention is used then."""
    source = SOURCE.read_bytes()
    try:
        version = subprocess.run(
            [_compiler(), "--version"], capture_output=True, text=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError) as error:
        warnings.warn(
            f"petfunc: no C++ compiler ({_compiler()}: {error}) for the fused attention kernels, "
            "the decomposed attention is used instead",
            stacklevel=2,
        )
        return None
    key = hashlib.sha256(
        source + " ".join(_FLAGS).encode() + version.encode() + _cpu_flags().encode()
    ).hexdigest()[:24]
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    folder = Path(cache_dir()) / "petfunc_attention"
    path = folder / f"attention_{key}.so"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        # build next to the target and rename: concurrent processes (ddp ranks) each
        # build their own file and the last rename wins, never a half-written library
        with tempfile.TemporaryDirectory(dir=folder) as tmp:
            built = Path(tmp) / path.name
            result = subprocess.run(
                [_compiler(), *_FLAGS, str(SOURCE), "-o", str(built)], capture_output=True, text=True
            )
            if result.returncode != 0:
                warnings.warn(
                    f"petfunc: building the fused attention kernels failed, the decomposed attention "
                    f"is used instead:\n{result.stderr[-2000:]}",
                    stacklevel=2,
                )
                return None
            os.replace(built, path)
    lib = ctypes.CDLL(str(path))
    i64, f64, cint, ptr = ctypes.c_int64, ctypes.c_double, ctypes.c_int, ctypes.c_void_p
    sizes = [i64, i64, i64, i64, f64, cint]
    for suffix in ("f32", "f64"):
        getattr(lib, f"petfunc_attention_forward_{suffix}").argtypes = [ptr] * 3 + sizes
        getattr(lib, f"petfunc_attention_backward_{suffix}").argtypes = [ptr] * 5 + sizes
        getattr(lib, f"petfunc_attention_backward2_{suffix}").argtypes = [ptr] * 8 + sizes
    return lib
