"""Training-step speed: metatrain eager vs petfunc eager vs petfunc compiled.

One run, side by side, the same default-PET weights and the same batches:

* qm9_reduced_100, batch 8, energy only (the setting of metatrain's compile PR);
* carbon_reduced_100, batch 8, energy + forces + stress.

metatrain's step is computed the way its trainer does it: ``model.train()``,
``evaluate_model(..., is_training=True)`` (forces/strain gradients with
``create_graph=True``), the loss of spec section 9, ``loss.backward()``,
``clip_grad_norm_(1.0)`` and ``torch.optim.Adam``. petfunc runs ``make_train_step``
eagerly with ``autodiff="autograd"`` ("eager": what ``petfunc train`` runs without
compile), eagerly with ``autodiff="func"`` ("eager func": torch.func, the traced
formulation run eagerly) and through ``petfunc.compile`` ("compiled": make_fx of the
torch.func step + inductor).
Timings are interleaved (metatrain, eager, eager func, compiled, metatrain, ...) over the same
batches; we print medians, ratios, compile time, break-even step count, FLOPs of
the step (torch.utils.flop_counter) and the achieved FLOP rate of the compiled step.
With ``--dataset both`` the carbon compile follows qm9's in the same process, which
has already done inductor's once-per-process work (its probe of the CPU's vector
instruction sets, preprocessing and hashing the C++ header it precompiles):
``--dataset carbon`` alone times a cold one. (The precompiled header itself is kept
by torch in ``$TMPDIR/torchinductor_$USER`` whatever ``TORCHINDUCTOR_CACHE_DIR`` says,
so only a machine's very first compile builds it.)
Memory: the peak tensor memory one step allocates on top of what exists before it
(CPU: profiler allocation events; CUDA: ``max_memory_allocated``), on the largest batch.

    python benchmarks/train_step.py [--dataset qm9|carbon|both] [--steps 10] [--dtype float32]
                                    [--threads 2] [--device cpu|cuda] [--variants ...] [--profile]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch


sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's petfunc, not an installed one
import petfunc
from petfunc.data import sample_from_atoms


sys.path.insert(0, str(Path(__file__).resolve().parent))
from _measure import add_malloc_option, apply_malloc, peak_tensor_memory


HERE = Path(__file__).resolve().parent
# ../shared/data next to the checkout; PETFUNC_BENCH_DATA overrides it, so that a
# benchmark comparing another checkout (a worktree elsewhere) reads the same files
DATA = Path(os.environ.get("PETFUNC_BENCH_DATA") or HERE.parent.parent / "shared" / "data")


def frames(name: str):
    """The structures of one dataset (ase.Atoms) from ../shared/data, or a generated stand-in."""
    import ase.io

    path = DATA / ("qm9_reduced_100.xyz" if name == "qm9" else "carbon_reduced_100.xyz")
    if path.exists():
        return ase.io.read(path, ":")
    print(f"# {path} not found: using generated structures instead")
    return _generated(name)


def samples_from_frames(name: str, frames, config, sample_from_atoms=sample_from_atoms):
    """Training samples of ``frames`` (qm9: energy only; carbon: energy, forces, virial)."""
    samples = []
    for atoms in frames:
        if name == "qm9":
            energy = atoms.info.get("U0", atoms.info.get("energy"))
            s = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
            s.energy = float(energy)
        else:
            s = sample_from_atoms(
                atoms, config, energy_key="energy", forces_key="force", stress_key=None, virial_key="virial"
            )
        samples.append(s)
    return samples


def _generated(name):
    if name != "qm9":
        from _measure import emt_carbon_frames

        return emt_carbon_frames(64)
    import ase.build

    frames = []
    rng = np.random.default_rng(0)
    for i in range(64):
        atoms = ase.build.molecule(["CH3CH2OH", "C6H6", "CH3COOH", "C4H4O"][i % 4])
        atoms.rattle(0.05, seed=i)
        atoms.info["energy"] = float(rng.normal())
        frames.append(atoms)
    return frames


def atomic_types(name):
    return (1, 6, 7, 8, 9) if name == "qm9" else (6,)


# ---------------------------------------------------------------------------------------


class MetatrainStep:
    """metatrain's eager training step on the same weights (trainer semantics)."""

    def __init__(self, config, params, dtype, weights, device="cpu"):
        sys.path.insert(0, str(HERE.parent / "tests"))
        import mtt_reference as ref
        from metatrain.utils.data.target_info import get_energy_target_info

        self.model = ref.make_model(config)
        # metatrain's composition model keeps its weights in TensorMaps made on the CPU
        ref.load_params(self.model, petfunc.tree.tree_map(lambda t: t.cpu(), params))
        self.model = self.model.to(dtype=dtype, device=device).train()
        self.device = device
        self.weights = weights
        self.info = get_energy_target_info(
            "energy",
            {"quantity": "energy", "unit": "eV"},
            add_position_gradients=weights.forces.weight > 0,
            add_strain_gradients=weights.stress.weight > 0,
        )
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=1e-4)
        self.dtype = dtype

    def systems(self, samples):
        import ase
        from metatomic.torch import systems_to_torch
        from metatrain.utils.neighbor_lists import get_system_with_neighbor_lists

        frames = [
            ase.Atoms(
                numbers=s.structure.numbers,
                positions=s.structure.positions,
                cell=s.structure.cell,
                pbc=s.structure.pbc,
            )
            for s in samples
        ]
        systems = systems_to_torch(frames, dtype=self.dtype)
        requested = self.model.requested_neighbor_lists()
        return [get_system_with_neighbor_lists(s, requested).to(self.device) for s in systems]

    def __call__(self, systems, batch):
        from metatrain.utils.evaluate_model import evaluate_model

        self.optimizer.zero_grad()
        block = evaluate_model(self.model, systems, {"energy": self.info}, is_training=True)["energy"].block()
        n = torch.tensor([len(s) for s in systems], dtype=self.dtype, device=self.device)
        valid = ~torch.isnan(batch.energy[: len(systems)])
        loss = ((block.values[:, 0] - batch.energy[: len(systems)]) / n)[valid].pow(2).mean()
        if self.weights.forces.weight > 0:
            target = batch.forces[: block.gradient("positions").values.shape[0]]
            loss = loss + (block.gradient("positions").values[:, :, 0] + target).pow(2).mean()
        if self.weights.stress.weight > 0:
            target = batch.strain_derivative[: len(systems)]
            pred = block.gradient("strain").values[:, :, :, 0]
            loss = loss + ((pred - target) / n[:, None, None]).pow(2).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.optimizer.step()
        return loss.detach()


def median_ms(values):
    return 1e3 * statistics.median(values)


def setup(name, dtype, n_batches, device="cpu", pkg=petfunc, structures=None, params=None):
    """The benchmark's default PET, optimizer, training step and first ``n_batches``
    batches of 8 (a fixed shuffle) for one dataset (a ``SimpleNamespace``).

    ``pkg`` is the petfunc package to build them with (``compare_step.py`` passes
    another checkout's), ``structures`` the frames (default :func:`frames`) and
    ``params`` flat weights (``{dotted.path: tensor}``) to start from, copied,
    instead of a fresh initialisation.
    """
    config = pkg.PETConfig(atomic_types=atomic_types(name))
    structures = frames(name) if structures is None else structures
    dataset = pkg.data.Dataset(
        samples_from_frames(name, structures, config, pkg.data.sample_from_atoms), config
    )
    energy_only = name == "qm9"
    weights = pkg.LossWeights.make(forces=0.0 if energy_only else 1.0, stress=0.0 if energy_only else 1.0)
    composition, scale = dataset.fit_composition_and_scale()
    model = pkg.PET(config)
    if params is None:
        params = model.init(seed=0, dtype=dtype, device=device)
        params["composition_weights"] = torch.tensor(composition, dtype=dtype, device=device)
        params["energy_scale"] = torch.tensor(scale, dtype=dtype, device=device)
    else:
        params = pkg.tree.unflatten(
            {k: v.to(dtype=dtype, device=device, copy=True) for k, v in params.items()}
        )
    optimizer = pkg.make_optimizer(1e-4)
    order = np.random.default_rng(0).permutation(len(dataset))
    chunks = [order[i : i + 8] for i in range(0, len(order) - 7, 8)][:n_batches]
    samples = [[dataset.samples[i] for i in c] for c in chunks]
    return SimpleNamespace(
        config=config,
        energy_only=energy_only,
        weights=weights,
        model=model,
        params=params,
        optimizer=optimizer,
        state=pkg.init_state(params, optimizer),
        step=pkg.make_train_step(model, optimizer, weights),
        samples=samples,
        batches=[
            pkg.data.make_batch(s, config, composition, scale, dtype=dtype, device=device) for s in samples
        ],
    )


VARIANTS = ("metatrain", "eager", "eager func", "compiled")
#: also selectable: the compiled step with other ``petfunc.compile`` arguments. "compiled
#: fused": the fused CPU attention kernels; "compiled cpp_wrapper": inductor's C++
#: wrapper instead of its Python one (the code that launches the kernels). Each is a
#: compile of its own, after the plain one (so not a cold compile); one that fails to
#: compile is reported and left out, the other variants still run.
EXTRA_COMPILED = {
    "compiled fused": dict(fused_attention=True),
    "compiled cpp_wrapper": dict(options={"cpp_wrapper": True}),
}
EXTRA_VARIANTS = tuple(EXTRA_COMPILED)


def gpu_profile(call, indices, label):
    """Where a GPU step's time goes: wall time per step under the profiler, the GPU
    operations (kernels, copies) launched per step and the time the GPU spends in
    them. A step whose GPU time is a small part of its wall time is bound by
    launching kernels (Python and C++ overhead), not by the GPU."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    indices = list(indices)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        for i in indices:
            call(i)
        wall = time.perf_counter() - start
    on_gpu = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    busy = sum(e.time_range.elapsed_us() for e in on_gpu) / 1e3
    n = len(indices)
    print(
        f"# profile {label}: {1e3 * wall / n:.1f} ms/step under the profiler; {len(on_gpu) / n:.0f} GPU "
        f"operations per step, GPU busy {busy / n:.2f} ms/step ({busy / (1e3 * wall):.0%} of the wall time)"
    )


def run(
    name,
    steps,
    dtype,
    backend,
    warmup=2,
    variants=VARIANTS,
    device="cpu",
    peak_gflops=None,
    first_compile=True,
    profile=False,
):
    """Benchmark one dataset; ``first_compile`` false: an earlier dataset of this
    process was compiled already (its compile time is then not a cold one);
    ``profile``: on a GPU, also :func:`gpu_profile` each compiled variant."""
    torch.manual_seed(0)
    bench = setup(name, dtype, steps + warmup, device)
    config, energy_only, weights, model, params = (
        bench.config,
        bench.energy_only,
        bench.weights,
        bench.model,
        bench.params,
    )
    optimizer, state, step, samples, batches = (
        bench.optimizer,
        bench.state,
        bench.step,
        bench.samples,
        bench.batches,
    )
    step_autograd = petfunc.make_train_step(model, optimizer, weights, autodiff="autograd")
    atoms = [b.positions.shape[0] for b in batches]
    widths = [b.neighbors.nef_index.shape[1] for b in batches]
    print(f"\n## {name}: batch 8, {'energy only' if energy_only else 'energy + forces + stress'}, {dtype}")
    print(f"# {len(batches)} batches, atoms {min(atoms)}-{max(atoms)}, NEF width {min(widths)}-{max(widths)}")

    results = {}
    compiled_state = None
    if "metatrain" in variants:
        mtt = MetatrainStep(config, params, dtype, weights, device)
        mtt_systems = [mtt.systems(s) for s in samples]
    if "compiled" in variants:
        # the compiled step donates its state, as `petfunc train` does: it trains its
        # own copy, step after step (metatrain's step updates its model too)
        compiled_state = petfunc.init_state(petfunc.tree.tree_map(lambda t: t.clone(), params), optimizer)
        start = time.perf_counter()
        compiled = petfunc.compile(step, compiled_state, batches[0], backend=backend, donate_argnums=(0,))
        trace_time = time.perf_counter() - start
        compiled_state, _ = compiled(compiled_state, batches[0])
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize()
        compile_time = time.perf_counter() - start
        results["compile_s"] = compile_time
        print(
            f"# petfunc.compile: trace {trace_time:.1f} s, trace + compile + first call {compile_time:.1f} s"
        )
        if not first_compile and backend == "inductor":
            # inductor's once-per-process work was paid by the previous dataset's
            # compile: not a fully cold compile
            print(
                "# (not the process's first compile: inductor's one-time setup (imports, its probe of the CPU, "
                "its check of the precompiled C++ header) ran in the previous one; run this dataset alone "
                "for a cold compile)"
            )
        if os.environ.get("PETFUNC_COMPILE_TIMES"):
            print(torch._dynamo.utils.compile_times(repr="str", aggregate=True))

    extra = {}  # variant -> [compiled step, its own donated state]
    for v in [v for v in variants if v in EXTRA_COMPILED]:
        own = petfunc.init_state(petfunc.tree.tree_map(lambda t: t.clone(), params), optimizer)
        start = time.perf_counter()
        try:
            fn = petfunc.compile(
                step, own, batches[0], backend=backend, donate_argnums=(0,), **EXTRA_COMPILED[v]
            )
            own, _ = fn(own, batches[0])
            if torch.device(device).type == "cuda":
                torch.cuda.synchronize()
        except Exception as error:  # noqa: BLE001 - an experimental setting: report it, time the others
            print(f"# {v}: failed to compile or run, left out: {type(error).__name__}: {str(error)[:2000]}")
            continue
        extra[v] = [fn, own]
        after = " (after the other compile: not a cold one)" if "compiled" in variants else ""
        print(f"# {v}: trace + compile + first call {time.perf_counter() - start:.1f} s{after}")
    variants = tuple(v for v in variants if v not in EXTRA_COMPILED or v in extra)

    cuda = torch.device(device).type == "cuda"

    def call(v, i):
        nonlocal compiled_state
        if v == "metatrain":
            mtt(mtt_systems[i], batches[i])
        elif v == "eager":
            step_autograd(state, batches[i])
        elif v == "eager func":
            step(state, batches[i])
        elif v in extra:
            fn, own = extra[v]
            extra[v][1], _ = fn(own, batches[i])
        else:
            compiled_state, _ = compiled(compiled_state, batches[i])
        if cuda:
            torch.cuda.synchronize()

    def step_memory(v, i):
        if not cuda:
            return peak_tensor_memory(lambda: call(v, i))
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        call(v, i)
        return (torch.cuda.max_memory_allocated() - before) / 2**20

    times = {v: [] for v in variants}
    for i in range(len(batches)):
        for v in variants:
            start = time.perf_counter()
            call(v, i)
            if i >= warmup:
                times[v].append(time.perf_counter() - start)
    # working memory of one step (tensor allocations, profiler), on the largest batch
    largest = max(range(len(batches)), key=lambda i: batches[i].neighbors.nef_mask.numel())
    memory = {v: step_memory(v, largest) for v in variants}
    if "compiled" in variants:
        results["num_graphs"] = compiled.num_graphs
    if profile and cuda:
        for v in [v for v in variants if v.startswith("compiled")]:
            gpu_profile(lambda i, v=v: call(v, i), range(warmup, min(len(batches), warmup + 6)), v)

    # FLOPs of every timed step (petfunc eager; the compiled graph runs the same
    # matmuls). Batches differ by up to 2x in FLOPs, so the rate is total FLOPs over
    # total compiled time, not the FLOPs of one batch over the median time.
    from torch.utils.flop_counter import FlopCounterMode

    step_flops = []
    for i in range(warmup, len(batches)):
        with FlopCounterMode(display=False) as counter:
            step(state, batches[i])
        step_flops.append(counter.get_total_flops())
    flops = float(np.mean(step_flops))

    med = {v: median_ms(t) for v, t in times.items()}
    base = med.get("metatrain")
    print("| variant | median ms/step | speed-up vs metatrain eager | peak step memory (MiB) |")
    print("|---|---|---|---|")
    for v in variants:
        ratio = f"{base / med[v]:.2f}x" if base else "-"
        print(f"| {v} | {med[v]:.1f} | {ratio} | {memory[v]:.0f} |")
    if "compiled" in variants:
        # break-even: the steps after which the compile has paid for itself against
        # each eager step timed in this run
        even = []
        for other, label in (("eager", "petfunc eager"), ("metatrain", "metatrain eager")):
            if other in med:
                gain = (med[other] - med["compiled"]) / 1e3
                even.append(
                    f"{results['compile_s'] / gain:.0f} steps vs {label}"
                    if gain > 0
                    else f"never vs {label} (not faster)"
                )
        rate = sum(step_flops) / sum(times["compiled"]) / 1e9
        share = f" ({100 * rate / peak_gflops:.0f} % of the measured matmul peak)" if peak_gflops else ""
        print(
            f"# step FLOPs {flops / 1e9:.2f} GFLOP on average ({min(step_flops) / 1e9:.2f}-"
            f"{max(step_flops) / 1e9:.2f}); compiled achieves {rate:.1f} GFLOP/s{share}"
        )
        print(
            f"# compile {results['compile_s']:.1f} s; break-even after "
            f"{', '.join(even) if even else '- (no eager step timed)'}; graphs compiled: {results['num_graphs']}"
        )
        results["gflops_per_s"] = rate
        if peak_gflops:
            # nearly all of the step's FLOPs are matmuls: at the measured peak they alone
            # would take this long, which bounds any speed-up from fusing the rest
            floor = flops / peak_gflops / 1e6
            bound = f"; at most {base / floor:.2f}x metatrain eager" if base else ""
            print(f"# matmul floor at the measured peak: {floor:.1f} ms/step{bound}")
    results.update(median_ms=med, flops=flops, peak_step_memory_mib=memory)
    return results


def peak_matmul_gflops(dtype, device):
    """Measured peak of a large matmul on this device (all torch threads on CPU)."""
    a = torch.randn(2048, 2048, dtype=dtype, device=device)
    b = torch.randn(2048, 2048, dtype=dtype, device=device)
    cuda = torch.device(device).type == "cuda"
    best = float("inf")
    for _ in range(6):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        a @ b
        if cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * 2048**3 / best / 1e9


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dataset", choices=["qm9", "carbon", "both"], default="both")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--dtype", choices=["float32", "float64"], default="float32")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (all variants run there)")
    parser.add_argument(
        "--variants",
        nargs="+",
        default=list(VARIANTS),
        choices=VARIANTS + EXTRA_VARIANTS,
        help="the steps to time (default: all; leave out metatrain where it is not installed)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="on a GPU: kernels launched and GPU busy time per compiled step (torch.profiler)",
    )
    add_malloc_option(parser)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    apply_malloc(args)
    dtype = getattr(torch, args.dtype)
    if torch.device(args.device).type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False  # same arithmetic for every variant
    names = ["qm9", "carbon"] if args.dataset == "both" else [args.dataset]
    peak = peak_matmul_gflops(dtype, args.device)
    print(
        f"# torch {torch.__version__}, device {args.device}, {torch.get_num_threads()} CPU threads, "
        f"malloc {args.malloc}; measured matmul peak {peak:.0f} GFLOP/s ({args.dtype})"
    )
    for i, name in enumerate(names):
        run(
            name,
            args.steps,
            dtype,
            args.backend,
            variants=tuple(args.variants),
            device=args.device,
            peak_gflops=peak,
            first_compile=i == 0,
            profile=args.profile,
        )


if __name__ == "__main__":
    main()
