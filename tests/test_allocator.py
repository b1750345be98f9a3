"""petfunc.allocator: glibc keeps freed blocks for the next step."""

import subprocess
import sys
import textwrap

import pytest

from petfunc import allocator


# run in a fresh process: the before/after comparison needs glibc's defaults
_PROBE = textwrap.dedent(
    """
    import ctypes
    from petfunc.allocator import keep_freed_memory

    class Info(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
            "uordblks", "fordblks", "keepcost")]

    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = Info
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]

    def mapped_while_holding(size):
        block = libc.malloc(size)
        info = libc.mallinfo2()
        libc.free(block)
        return info.hblkhd, libc.mallinfo2().arena

    size = 64 << 20
    before, _ = mapped_while_holding(size)
    assert keep_freed_memory() and keep_freed_memory()
    after, arena = mapped_while_holding(size)
    print(before, after, arena)
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc only")
def test_keep_freed_memory_serves_large_blocks_from_the_heap():
    run = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True)
    if "mallinfo2" in run.stderr:
        pytest.skip("glibc older than 2.33 (no mallinfo2)")
    assert run.returncode == 0, run.stderr
    before, after, arena = map(int, run.stdout.split())
    size = 64 << 20
    # glibc's default: a 64 MiB block is its own mmap, unmapped at free
    assert before >= size
    # kept: it comes from the heap, which is not trimmed after the free
    assert after < size
    assert arena >= size


def test_cli_applies_it(monkeypatch, tmp_path):
    from petfunc.cli import commands as cli

    calls = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: calls.append(1) or True)
    assert cli.main(["eval", str(tmp_path / "missing.ckpt"), str(tmp_path / "missing.xyz")]) == 2
    assert calls == [1]
