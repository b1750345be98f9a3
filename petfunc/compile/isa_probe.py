"""Inductor's probe of the CPU's vector instruction sets, run early in a background
thread (compile machinery: it calls torch, it changes nothing in it).

Inductor asks for the probe (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``) when
it generates its first C++ kernel. With an empty cache it builds a test program for
each candidate instruction set and loads each in a fresh Python process: seconds of
a cold compile, spent in ``g++`` and subprocesses while the compiling thread waits.
Started before ``make_fx`` traces (single-threaded Python), it runs on another core
meanwhile. The probe caches its answer in the process (``functools.cache``), so
inductor then finds it done; :func:`wait` must be called before inductor runs, so
that the two never probe at once. ``PETFUNC_EARLY_ISA_PROBE=0`` turns this off
(``benchmarks/cold_compile.py --variants grouped late_probe`` shows the difference).
"""

from __future__ import annotations

import threading

from petfunc._torch import settings


#: the background thread of :func:`start`, once started (once per process)
thread: threading.Thread | None = None


def start() -> None:
    """Start the probe in a background thread, once per process."""
    global thread
    if thread is not None or not settings.early_isa_probe():
        return
    # Every module the probe needs is imported here, in the calling thread. Imported
    # by the probe's thread while the caller imports torch._dynamo (make_fx's shape
    # environment does), torch's circular imports between _dynamo and _inductor
    # meet half-initialised modules: "cannot import name 'IndentedBuffer' from
    # partially initialized module 'torch._inductor.utils'" in the caller, and
    # torch._dynamo left broken for the rest of the process (torch 2.11 and 2.13,
    # in most runs of a script that imports torch._dynamo right after).
    import torch._dynamo
    import torch._inductor.codecache
    import torch._inductor.cpp_builder
    import torch.utils._filelock  # noqa: F401, PLC0415 - imported here (see above)
    from torch._inductor import cpu_vec_isa

    def probe():
        try:
            cpu_vec_isa.valid_vec_isa_list()
        except Exception:  # noqa: BLE001 - inductor probes again itself and reports
            pass

    thread = threading.Thread(target=probe, name="petfunc-isa-probe", daemon=True)
    thread.start()


def wait() -> None:
    """Wait for :func:`start`'s thread, if one was started."""
    if thread is not None:
        thread.join()
