"""Inductor's probe of the CPU's vector instruction sets, started while make_fx traces
(petfunc.compile.isa_probe)."""

import sys

import torch

import petfunc
from petfunc.compile import inductor, isa_probe


def test_vector_isa_probe_runs_once_in_the_background(monkeypatch):
    """``petfunc.compile`` with inductor on CPU starts inductor's probe of the vector
    instruction sets (7-10 s with an empty cache) in a thread while ``make_fx``
    traces, once per process, and joins it before inductor compiles; other
    backends do not start it, nor does ``PETFUNC_EARLY_ISA_PROBE=0``."""
    import threading

    import torch._inductor.cpu_vec_isa as cpu_vec_isa

    calls = []
    monkeypatch.setattr(
        cpu_vec_isa, "valid_vec_isa_list", lambda: calls.append(threading.current_thread().name)
    )
    monkeypatch.setattr(isa_probe, "thread", None)
    x = torch.randn(4, 3)

    petfunc.compile(lambda y: y.sin(), x, static_argnums=(), backend="aot_eager")
    assert isa_probe.thread is None
    monkeypatch.setenv("PETFUNC_EARLY_ISA_PROBE", "0")
    petfunc.compile(lambda y: y.sin(), x, static_argnums=())
    assert isa_probe.thread is None
    monkeypatch.delenv("PETFUNC_EARLY_ISA_PROBE")

    compiled = petfunc.compile(lambda y: y.sin(), x, static_argnums=())  # traces; no compile yet
    probe = isa_probe.thread
    assert probe is not None and probe.name == "petfunc-isa-probe"
    isa_probe.start()  # once per process
    assert isa_probe.thread is probe
    waited = []
    monkeypatch.setattr(isa_probe, "wait", lambda: waited.append("wait"))
    monkeypatch.setattr(
        inductor,
        "compile_inductor_direct",
        lambda *args: waited.append("compile") or (lambda *inputs: inputs[0].sin()),
    )
    compiled(x)
    assert waited == ["wait", "compile"]  # joined before inductor compiles
    probe.join()
    assert calls == ["petfunc-isa-probe"]


def test_vector_isa_probe_does_not_race_the_callers_imports(tmp_path):
    """The probe's thread imports nothing: with its imports in that thread, a caller
    importing ``torch._dynamo`` meanwhile (as ``petfunc.compile`` does right after
    starting it) met torch's half-initialised modules in most runs ("cannot import
    name 'IndentedBuffer' from partially initialized module") and was left with a
    broken ``torch._dynamo``. Fresh processes, as that needs; two runs, each failed
    before the fix on torch 2.11 and 2.13."""
    import os
    import subprocess

    script = (
        "import torch\n"
        "from petfunc.compile import isa_probe\n"
        "isa_probe.start()\n"
        "import torch._dynamo\n"
        "from torch.fx.experimental.symbolic_shapes import ShapeEnv\n"
        "ShapeEnv()\n"
        "isa_probe.wait()\n"
        "print('imports ok')\n"
    )
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    for _ in range(2):
        run = subprocess.run(
            [sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300
        )
        assert run.returncode == 0 and "imports ok" in run.stdout, run.stderr[-2000:]
