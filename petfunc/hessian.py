"""Second derivatives of the energy with respect to positions: Hessians and
Hessian-vector products.

For an energy function ``energy_fn(params, positions, cell, neighbors) ->
[n_structures]`` the functions here differentiate the *total* energy
``E = sum_s E_s`` twice:

* ``hvp(energy_fn)(params, positions, cell, neighbors, v) -> H v`` ``[n_atoms, 3]``:
  about the cost of two force evaluations, any system size;
* ``hessian(energy_fn)(params, positions, cell, neighbors) -> H`` ``[n_atoms, 3,
  n_atoms, 3]`` with ``H[i, a, j, b] = d2E / dx_ia dx_jb`` (eV/Å^2): HVPs with all
  3 n_atoms unit vectors, vmapped;
* ``hessian(energy_fn, chunk_size=k)``: the same matrix, k rows at a time, so the
  memory of the derivative pass is that of k HVPs whatever the system size
  (the result itself is 9 n_atoms^2 numbers);
* ``hessian(energy_fn, memory_budget=bytes)``: k chosen per call from the measured
  memory of 2 and 4 rows (the 4 rows are kept as the first rows of the matrix),
  so that the pass and the matrix fit the budget.

**Cost.** A row costs about two force evaluations plus a share of the gradient
graph, which is built once per call. Small chunks are fastest per row on a CPU
(larger vmaps push each layer's tensors out of the cache; ``benchmarks/hessian.py``
measures it, benchmarks/README.md has the figures). A central finite difference
costs 2 force evaluations per row, but is about 1e-6 off; fourth-order differences
(4 per row) come to about 1e-11.

**Two modes.** ``mode="reverse"`` (default) is reverse-over-reverse: the gradient
g(x) = dE/dx and its backward graph are built once, then ``vjp`` of g with each
direction (``jacrev(grad)``). ``mode="forward"`` is forward-over-reverse: a ``jvp``
of g along each direction (``jacfwd(grad)``). Both give the same matrix (to
round-off; H is symmetric, so rows and columns agree). Only the reverse mode traces
shape-generically: forward-mode AD reads integer sizes when it stores a tangent
(``make_fx`` then bakes the trace batch's sizes into the graph: "The expanded size
of the tensor (90) must match the existing size (26)"), so :func:`petfunc.compile`
of a forward-mode function only works for the traced sizes. Through PET the trace
can also fail outright on torch <= 2.13 ("FakeTensorDeviceMismatchError ... meta and
cpu": forward mode's efficient zero tangents take the meta device under fake
tensors, a torch bug fixed upstream in pytorch/pytorch#185718). Use forward mode in
eager code only.

**Batches.** Structures of a batch share no atoms, so the Hessian of the total
energy is block diagonal: entries between atoms of different structures are
exactly zero, and the block of structure s is that structure's own Hessian. The
functions return the full ``[n_atoms, 3, n_atoms, 3]`` matrix of the batch;
:func:`structure_blocks` cuts out the per-structure blocks. (For many structures,
prefer one structure per call or HVPs: the full matrix is mostly zeros.)

The Hessian is ``-dF/dx``: positive curvature at a minimum. Cell and strain are
held fixed (no strain derivatives).

**Derivatives of these functions.** Their parameter gradients (a Hessian- or
HVP-matching loss written by hand; :mod:`petfunc.train.hessian_loss` is the packaged one)
are third derivatives of the layers. PyTorch's own third derivative of layer
norm is wrong (10-40 % off on the first layer's weights of a default PET), so
both modes run with layer norm decomposed into elementary operations
(``decompose_layer_norm`` of :func:`~petfunc.compile.symbolic_vmap_rules`);
the Hessians themselves are the same to round-off, and took the same time.
(:func:`petfunc.model.nn.layer_norm` also decomposes itself under three nested
``torch.func`` derivatives, or two with forward mode inside, so hand-written
third derivatives are right without this module.)

The functions trace with :func:`petfunc.compile` into one graph for every system
size (the vmaps run under :func:`petfunc.compile.symbolic_vmap_rules`). The
chunked Hessian loops in Python over chunks: compile its row function
(:func:`hessian_rows`) and pass it to :func:`chunked_hessian`.
"""

from __future__ import annotations

import contextlib
import os
import re
import sys
import tempfile
from collections.abc import Callable

import torch
from torch.func import grad, jvp, vjp, vmap
from torch.profiler import ProfilerActivity, profile

from petfunc.compile import symbolic_vmap_rules


_MODES = ("reverse", "forward")


def _check_mode(mode: str) -> str:
    if mode not in _MODES:
        raise ValueError(f"mode must be one of {_MODES}, got {mode!r}")
    return mode


def _energy_gradient(energy_fn, params, cell, neighbors):
    def total(x):
        return energy_fn(params, x, cell, neighbors).sum()

    return grad(total)


def _hvp(energy_fn, params, positions, cell, neighbors, v, mode: str):
    gradient = _energy_gradient(energy_fn, params, cell, neighbors)
    if mode == "forward":
        return jvp(gradient, (positions,), (v,))[1]
    return vjp(gradient, positions)[1](v)[0]


def hvp(energy_fn: Callable, mode: str = "reverse") -> Callable:
    """``fn(params, positions, cell, neighbors, v [n_atoms, 3]) -> H v [n_atoms, 3]``
    (eV/Å^2 times the units of v). ``mode``: see the module docstring."""
    _check_mode(mode)

    def fn(params, positions, cell, neighbors, v):
        if (
            all(type(n) is int for n in tuple(v.shape) + tuple(positions.shape))
            and v.shape != positions.shape
        ):
            raise ValueError(
                f"v must have the shape of positions {list(positions.shape)}, got {list(v.shape)}"
            )
        with symbolic_vmap_rules(decompose_layer_norm=True):
            return _hvp(energy_fn, params, positions, cell, neighbors, v, mode)

    return fn


def hessian_rows(energy_fn: Callable, mode: str = "reverse") -> Callable:
    """``fn(params, positions, cell, neighbors, directions [k, n_atoms, 3]) -> [k, n_atoms, 3]``:
    ``H d`` for each of k directions. With unit vectors as directions these are
    rows (= columns: H is symmetric) of the Hessian. ``mode``: see the module docstring.
    """
    _check_mode(mode)

    def forward(params, positions, cell, neighbors, directions):
        def one(v):
            return _hvp(energy_fn, params, positions, cell, neighbors, v, "forward")

        return vmap(one)(directions)

    def reverse(params, positions, cell, neighbors, directions):
        gradient = _energy_gradient(energy_fn, params, cell, neighbors)
        _, pullback = vjp(gradient, positions)  # g and its graph, built once
        return vmap(pullback)(directions)[0]

    rows = forward if mode == "forward" else reverse

    def fn(params, positions, cell, neighbors, directions):
        with symbolic_vmap_rules(decompose_layer_norm=True):
            return rows(params, positions, cell, neighbors, directions)

    return fn


def _unit_vectors(n_atoms: int, start, count: int, like: torch.Tensor) -> torch.Tensor:
    """``[count, n_atoms, 3]`` unit vectors e_start ... (rows past 3 n_atoms are zero)."""
    rows = torch.arange(count, device=like.device) + start
    columns = torch.arange(3 * n_atoms, device=like.device)
    return (rows[:, None] == columns[None, :]).to(like.dtype).reshape(count, n_atoms, 3)


def chunked_hessian(rows_fn: Callable, chunk_size: int) -> Callable:
    """Hessian ``[n_atoms, 3, n_atoms, 3]`` from a row function, ``chunk_size`` rows per call.

    Args:
        rows_fn: :func:`hessian_rows` of an energy function, or its compiled version
            (``petfunc.compile(hessian_rows(energy_fn), params, positions, cell,
            neighbors, directions)`` with ``directions`` of shape
            ``[chunk_size, n_atoms, 3]``).
        chunk_size: rows per call (>= 2). The last chunk is padded with zero
            directions so every call has the same number of rows (one compiled graph).
    """
    if int(chunk_size) < 2:
        raise ValueError(f"chunk_size must be at least 2, got {chunk_size}")
    k = int(chunk_size)

    def fn(params, positions, cell, neighbors):
        n = positions.shape[0]
        return _rows_from(rows_fn, k, 0, params, positions, cell, neighbors).reshape(n, 3, n, 3)

    return fn


def _rows_from(rows_fn: Callable, k: int, first: int, params, positions, cell, neighbors) -> torch.Tensor:
    """Rows ``first .. 3 n_atoms - 1`` of the Hessian, ``[3 n_atoms - first, n_atoms,
    3]``, ``k`` rows per call (the last call padded with zero directions)."""
    n = positions.shape[0]
    rows: list[torch.Tensor] = []
    for start in range(first, 3 * n, k):
        directions = _unit_vectors(n, start, k, positions)
        rows.append(rows_fn(params, positions, cell, neighbors, directions))
    if not rows:
        return positions.new_zeros((0, n, 3))
    return torch.cat(rows)[: 3 * n - first]


def working_memory(fn: Callable, *args) -> int:
    """Bytes of tensor memory ``fn(*args)`` allocates beyond what exists before the
    call, at its peak: CUDA's allocator statistics (their peak is reset), or on CPU
    the profiler's allocation events (independent of allocator caching; an error
    inside a running ``torch.profiler``, which a nested one would end)."""
    return _working_memory_and_output(fn, *args)[0]


def _working_memory_and_output(fn: Callable, *args):
    """``(working_memory(fn, *args), fn(*args))`` from one call.

    On CUDA this resets the device's peak-memory statistics
    (``torch.cuda.reset_peak_memory_stats``); on the CPU it runs torch's profiler,
    which cannot run inside another profiler: it is an error there."""
    device = next((a.device for a in args if isinstance(a, torch.Tensor)), torch.device("cpu"))
    if device.type != "cuda" and torch._C._autograd._profiler_enabled():
        # a nested profile would end the caller's and measure nothing (0 bytes)
        raise RuntimeError(
            "petfunc.hessian: measuring working memory on the CPU (memory_budget=, working_memory, "
            "chunk_size_for) uses torch's profiler, and a profiler is already running; call it outside "
            "the profile, or pass chunk_size= instead of memory_budget="
        )
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn(*args)
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before), out
    with _without_profiler_lines(), profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn(*args)
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    total = peak = 0
    for _, nbytes in events:
        total += nbytes
        peak = max(peak, total)
    return int(peak), out


# what torch's profiler (Kineto) prints to the process's stderr at every start and
# stop, e.g. "USDT:2026-12-06 03:12:48 12752:12752 SyncActivityProfilerHandler.cpp:52]
# profiler_start": noise to a user who asked for a Hessian
_PROFILER_LINE = re.compile(r"^USDT:.*\] profiler_(start|stop)\s*$")


@contextlib.contextmanager
def _without_profiler_lines():
    """Hold back the profiler's start/stop lines from stderr (file descriptor 2, where
    its C++ writes them); anything else written there meanwhile (warnings, errors)
    is passed on when the block ends."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError, AttributeError):  # no real stderr (some notebooks): nothing to hide
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            try:
                sys.stderr.flush()
            finally:
                os.dup2(saved, 2)
                os.close(saved)
            captured.seek(0)
            text = captured.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not _PROFILER_LINE.match(line)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


def chunk_size_for(rows_fn: Callable, params, positions, cell, neighbors, memory_budget: int) -> int:
    """The largest number of rows per call whose working memory, plus the Hessian
    itself, stays within ``memory_budget`` bytes: the memory of 2 and of 4 rows is
    measured (:func:`working_memory`) and extrapolated linearly. At least 2, at most
    3 n_atoms. Raises ``ValueError`` when not even 2 rows fit."""
    return _chunk_size_and_first_rows(rows_fn, params, positions, cell, neighbors, memory_budget)[0]


def _chunk_size_and_first_rows(rows_fn: Callable, params, positions, cell, neighbors, memory_budget: int):
    """:func:`chunk_size_for`, and the Hessian rows 0-3 its second measurement
    computed (``[4, n_atoms, 3]``), so that the Hessian does not compute them again."""
    n = positions.shape[0]
    result = 9 * n * n * positions.element_size()
    measured = {}
    for k in (2, 4):
        directions = _unit_vectors(n, 0, k, positions)
        measured[k], first_rows = _working_memory_and_output(
            rows_fn, params, positions, cell, neighbors, directions
        )
    per_row = max((measured[4] - measured[2]) / 2, 1.0)
    base = max(measured[2] - 2 * per_row, 0.0)
    k = int((memory_budget - result - base) // per_row)
    if k < 2:
        raise ValueError(
            f"memory_budget {memory_budget / 2**20:.1f} MiB is too small for the Hessian of "
            f"{n} atoms: the matrix takes {result / 2**20:.1f} MiB and 2 rows at a time "
            f"{measured[2] / 2**20:.1f} MiB more (measured)"
        )
    return min(k, 3 * n), first_rows


def hessian(
    energy_fn: Callable,
    chunk_size: int | None = None,
    mode: str = "reverse",
    memory_budget: int | None = None,
) -> Callable:
    """``fn(params, positions, cell, neighbors) -> H [n_atoms, 3, n_atoms, 3]`` (eV/Å^2).

    ``H[i, a, j, b] = d2 E / dx_ia dx_jb`` of the total energy of the batch
    (block diagonal over structures, see the module docstring).

    Args:
        energy_fn: ``energy_fn(params, positions, cell, neighbors) -> [n_structures]``.
        chunk_size: ``None``: all 3 n_atoms rows in one vmap (memory of 3 n_atoms
            HVPs). An integer k: k rows at a time (memory of k HVPs). On CPU,
            small k (2-4) is fastest (see the module docstring).
        mode: ``"reverse"`` or ``"forward"`` (see the module docstring).
        memory_budget: bytes (instead of ``chunk_size``): each call measures the
            working memory of 2 and 4 rows on its inputs and takes as many rows at a
            time as fit, the matrix itself included (:func:`chunk_size_for`); the 4
            measured rows are kept, so 2 rows of extra work in all.
    """
    rows_fn = hessian_rows(energy_fn, mode)
    if memory_budget is not None:
        if chunk_size is not None:
            raise ValueError("give chunk_size or memory_budget, not both")

        def budgeted(params, positions, cell, neighbors):
            k, first = _chunk_size_and_first_rows(rows_fn, params, positions, cell, neighbors, memory_budget)
            n = positions.shape[0]
            # rows 0-3 come from the measurement; the rest in chunks of k
            rest = _rows_from(rows_fn, k, 4, params, positions, cell, neighbors)
            return torch.cat([first, rest])[: 3 * n].reshape(n, 3, n, 3)

        return budgeted
    if chunk_size is not None:
        return chunked_hessian(rows_fn, chunk_size)

    def fn(params, positions, cell, neighbors):
        n = positions.shape[0]
        eye = torch.eye(3 * n, dtype=positions.dtype, device=positions.device)
        return rows_fn(params, positions, cell, neighbors, eye.reshape(3 * n, n, 3)).reshape(n, 3, n, 3)

    return fn


def structure_blocks(hessian_matrix: torch.Tensor, structure_index: torch.Tensor) -> list[torch.Tensor]:
    """Per-structure blocks ``[n_s, 3, n_s, 3]`` of a batch Hessian.

    Atoms of a structure must be contiguous (as :func:`petfunc.collate` builds them).
    """
    counts = torch.bincount(structure_index).tolist()
    blocks, start = [], 0
    for count in counts:
        stop = start + count
        blocks.append(hessian_matrix[start:stop, :, start:stop, :])
        start = stop
    return blocks


def mass_weighted(hessian_matrix: torch.Tensor, masses: torch.Tensor) -> torch.Tensor:
    """``H_ij / sqrt(m_i m_j)`` as a ``[3 n, 3 n]`` matrix (masses in amu)."""
    n = hessian_matrix.shape[0]
    inv = (1.0 / torch.sqrt(masses.to(hessian_matrix.dtype))).repeat_interleave(3)
    return hessian_matrix.reshape(3 * n, 3 * n) * inv[:, None] * inv[None, :]
