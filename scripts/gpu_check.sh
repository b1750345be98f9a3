#!/usr/bin/env bash
# GPU checks of petfunc in one run (< 10 minutes on one GPU), one results file.
#
# NOTE: this script has NOT been run on a GPU yet (none was available when it was
# written). It was only smoke-tested on CPU with `DEVICE=cpu BACKEND=aot_eager`.
# Expect to fix small things on its first GPU run.
#
#   bash scripts/gpu_check.sh [RESULTS_FILE]        (default: gpu_check_results.txt)
#
# Environment: DEVICE (default cuda), BACKEND (default inductor), PYTHON (default python),
# SMALL=1 (small models only), SKIP_EFS=1 (train step only): for CPU smoke tests;
# BUDGET (seconds for all steps, default 570).
#
# What it runs, each step under its own time limit, continuing after failures:
#   1. parity: petfunc on $DEVICE (float64) vs metatrain's eager PET (CPU, float64),
#      energies/forces/strain derivatives to 1e-10 (skipped without metatrain);
#   2. compiled == eager on $DEVICE in float32 and float64 (energy/forces/stress
#      function and the training step's gradient, 4 batch shapes), and exactly one compiled
#      graph each (zero recompilations);
#   2b. petfunc export (AOTInductor) for $DEVICE == eager on 3 sizes, float64;
#   3. benchmarks on $DEVICE: train_step.py, ensemble.py, md_step.py with short
#      options, each only if it accepts `--device` (else noted as skipped: they time
#      the CPU otherwise), and ddp.py (data parallel, 1..#GPU processes);
#      With >= 2 GPUs ddp.py also exercises NCCL (1..#GPUs processes).
set -u
cd "$(dirname "$0")/.."
OUT=${1:-gpu_check_results.txt}
DEVICE=${DEVICE:-cuda}
BACKEND=${BACKEND:-inductor}
PY=${PYTHON:-python}
export PYTHONUNBUFFERED=1
START=$(date +%s)
: > "$OUT"

log() { echo "$*" | tee -a "$OUT"; }

BUDGET=${BUDGET:-570}  # seconds for all steps together (the limits shrink to fit)
step() {  # step NAME SECONDS CMD...
    local name=$1 limit=$2; shift 2
    local left=$(( BUDGET - ($(date +%s) - START) ))
    if [ "$left" -lt 20 ]; then
        log ""; log "=== $name: SKIPPED (time budget spent)"; SKIPPED="$SKIPPED [$name]"; return
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    log ""
    log "=== $name (limit ${limit}s) ==="
    local t0=$(date +%s)
    timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$OUT"
    local rc=${PIPESTATUS[0]}
    log "--- $name: exit $rc, $(( $(date +%s) - t0 )) s"
    [ "$rc" -eq 0 ] && PASSED="$PASSED [$name]" || FAILED="$FAILED [$name]"
}

PASSED=""; FAILED=""; SKIPPED=""
log "petfunc GPU check, $(date -u +%FT%TZ), DEVICE=$DEVICE BACKEND=$BACKEND"
log "git: $(git rev-parse --short HEAD 2>/dev/null) $(git status --porcelain 2>/dev/null | wc -l) changed files"
$PY - <<'EOF' 2>&1 | tee -a "$OUT"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available(),
      "devices", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
EOF
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee -a "$OUT"

# ---------------------------------------------------------------------------------
# 1 + 2: correctness on the device
CHECKS=$(mktemp /tmp/petfunc_gpu_checks.XXXX.py)
cat > "$CHECKS" <<'EOF'
import os, sys, time
import numpy as np
import torch

sys.path.insert(0, "tests")
import petfunc

DEVICE = torch.device(os.environ.get("DEVICE", "cuda"))
BACKEND = os.environ.get("BACKEND", "inductor")
what = sys.argv[1]
failures = []


def rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-300))


def check(name, value, tol):
    ok = value <= tol
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {value:.3e} (tolerance {tol:.0e})", flush=True)
    if not ok:
        failures.append(name)


if what == "parity":
    try:
        import test_metatrain_parity as P
    except BaseException as error:  # metatrain missing (pytest's Skipped is a BaseException)
        print(f"SKIP parity: {type(error).__name__}: {error}")
        sys.exit(0)
    import mtt_reference as ref
    frames = P.frames()
    cases = [("small", P.SMALL)] if os.environ.get("SMALL") else [("default", {}), ("small", P.SMALL)]
    for name, hypers in cases:
        config = petfunc.PETConfig.from_hypers({"atomic_types": [1, 6, 7, 8], **hypers})
        params = P.random_params(config, seed=3)
        mtt = ref.make_model(config)
        ref.load_params(mtt, params)
        energy, per_atom, forces, strain = ref.evaluate(mtt, frames)  # CPU reference
        model = petfunc.PET(config)
        dparams = petfunc.tree.tree_map(lambda t: t.to(DEVICE), params)
        pos, cell, nbrs = petfunc.from_atoms(frames, config, dtype=torch.float64, device=DEVICE)
        e, f, w = petfunc.energy_forces_strain_derivative(model.energy)(dparams, pos, cell, nbrs)
        _, comp = P.composition(params, frames, config)
        check(f"parity {name} energy - composition", rel(e.cpu() - comp, energy - comp), 1e-10)
        check(f"parity {name} forces", rel(f, forces), 1e-10)
        check(f"parity {name} dE/dstrain", rel(w, strain), 1e-10)

elif what == "compiled":
    import ase.build
    from ase.calculators.emt import EMT
    from petfunc.data import make_batch, sample_from_atoms
    from petfunc.train import make_grad_step

    # default widths, one GNN layer of one attention layer (half the graph: compile time)
    small = dict(d_pet=16, d_node=32, d_head=16, d_feedforward=32, num_heads=2) if os.environ.get("SMALL") else {}
    config = petfunc.PETConfig.from_hypers({"atomic_types": [13, 29], "cutoff": 4.0, "num_gnn_layers": 1,
                                            "num_attention_layers": 1, **small})
    rng = np.random.default_rng(0)
    samples = []
    for k in range(12):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1 + k % 2, 1 + k % 3))
        atoms.numbers[rng.random(len(atoms)) < 0.3] = 13
        atoms.rattle(0.1, seed=k)
        atoms.calc = EMT()
        atoms.get_stress()
        samples.append(sample_from_atoms(atoms, config))
    groups = [[0, 1], [2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 0, 1]]  # 4 shapes
    dtype = getattr(torch, sys.argv[2])
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    for _ in [0]:
        tag = str(dtype).replace("torch.", "")
        model = petfunc.PET(config)
        params = model.init(seed=0, dtype=dtype, device=DEVICE)
        params["composition_weights"] = torch.zeros(2, dtype=dtype, device=DEVICE)
        params["energy_scale"] = torch.ones((), dtype=dtype, device=DEVICE)
        batches = [make_batch([samples[i] for i in g], config, [0.0, 0.0], 1.0, dtype=dtype, device=DEVICE)
                   for g in groups]
        efs = petfunc.energy_forces_strain_derivative(model.energy)

        def efs_fn(p, b):
            return efs(p, b.positions, b.cell, b.neighbors)

        t0 = time.perf_counter()
        if os.environ.get("SKIP_EFS"):
            batches_efs = []
        else:
            batches_efs = batches
            compiled = petfunc.compile(efs_fn, params, batches[0], backend=BACKEND)
        for i, b in enumerate(batches_efs):
            ref_out, out = efs_fn(params, b), compiled(params, b)
            for name, x, y in zip(("E", "F", "dE/deps"), out, ref_out):
                check(f"{tag} compiled E/F/S shape {i} {name}", rel(x, y), tol)
        if batches_efs:
            print(f"{tag} E/F/S: {compiled.num_graphs} graph(s), {time.perf_counter() - t0:.1f} s")
        if batches_efs and compiled.num_graphs != 1:
            failures.append(f"{tag} E/F/S recompiled")

        # the training step's gradient (grad of the E/F/S loss): compiled vs eager
        step = make_grad_step(model)
        t0 = time.perf_counter()
        cstep = petfunc.compile(step, params, batches[0], backend=BACKEND)
        for i, b in enumerate(batches):
            (g_ref, m_ref), (g_c, m_c) = step(params, b), cstep(params, b)
            check(f"{tag} compiled train step shape {i} loss", rel(m_c["loss"], m_ref["loss"]), tol)
            fr, fc = petfunc.tree.flatten(g_ref), petfunc.tree.flatten(g_c)
            top = max(float(v.abs().max()) for v in fr.values())
            worst = max(float((fc[k] - fr[k]).abs().max()) for k in fr) / top
            check(f"{tag} compiled train step shape {i} param gradients", worst, tol)
        print(f"{tag} train step: {cstep.num_graphs} graph(s), {time.perf_counter() - t0:.1f} s")
        if cstep.num_graphs != 1:
            failures.append(f"{tag} train step recompiled")

elif what == "export":
    # petfunc export for the device (AOTInductor), small model, float64 vs eager
    import tempfile
    import ase.build
    from petfunc import export as pexport
    from petfunc.data import padding_sample
    from petfunc.structures import collate, prepare_atoms

    config = petfunc.PETConfig(atomic_types=(1, 6, 8), num_neighbors_adaptive=12, d_pet=16, d_node=32,
                               d_head=16, d_feedforward=32, num_heads=2)
    params = petfunc.init(config, seed=3, dtype=torch.float64)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        path = pexport.export(config, params, os.path.join(scratch, "m.pt2"), dtype=torch.float64, device=DEVICE)
        print(f"export (AOTInductor, {DEVICE}): {time.perf_counter() - t0:.1f} s")
        model = pexport.load(path)
    fn = petfunc.derivatives.energy_terms_forces_strain_derivative(petfunc.PET(config).energy_terms)
    dparams = petfunc.tree.tree_map(lambda t: t.to(DEVICE), params)
    for repeat in ((1, 1, 1), (2, 1, 1), (2, 2, 1)):
        atoms = ase.build.bulk("C", "diamond", a=3.57, cubic=True).repeat(repeat)
        atoms.rattle(0.05, seed=1)
        x = collate([prepare_atoms(atoms, config), padding_sample(config).structure], config,
                    dtype=torch.float64, device=DEVICE)
        for name, a, b in zip(pexport.OUTPUTS, model(*x), fn(dparams, *x)):
            check(f"export {len(atoms)} atoms {name}", rel(a, b), 1e-10)

print("FAILURES:", failures if failures else "none")
sys.exit(1 if failures else 0)
EOF

step "parity vs metatrain ($DEVICE, float64)" 60 env DEVICE="$DEVICE" SMALL="${SMALL:-}" $PY "$CHECKS" parity
for DT in float64 float32; do
    step "compiled == eager, one graph ($DEVICE, $DT, $BACKEND)" 200 \
        env DEVICE="$DEVICE" BACKEND="$BACKEND" SMALL="${SMALL:-}" SKIP_EFS="${SKIP_EFS:-}" $PY "$CHECKS" compiled $DT
done

step "petfunc export, AOTInductor ($DEVICE, float64)" 150 env DEVICE="$DEVICE" $PY "$CHECKS" export

# ---------------------------------------------------------------------------------
# 3: benchmarks
bench() {  # bench FILE SECONDS ARGS...
    local name=$1 file=benchmarks/$1 limit=$2; shift 2
    if [ ! -f "$file" ]; then
        log ""; log "=== $file: SKIPPED (file does not exist)"; SKIPPED="$SKIPPED $name"; return
    fi
    if ! $PY "$file" --help 2>/dev/null | grep -q -- "--device"; then
        log ""; log "=== $file: SKIPPED (no --device option; it would time the CPU)"; SKIPPED="$SKIPPED $name"; return
    fi
    step "$file" "$limit" $PY "$file" --device "$DEVICE" "$@"
}
bench train_step.py 240 --steps 5 --dataset qm9
bench ensemble.py 45 --quick
bench md_step.py 45 --quick
bench ddp.py 60 --steps 10 --warmup 2 --batch 16

# 4: multi-GPU data parallel: ddp.py above runs 1..#GPUs processes on NCCL (the
# exactness tests, tests/test_distributed.py, run on CPU/gloo in the normal test suite).

rm -f "$CHECKS"
log ""
log "=== summary ($(( $(date +%s) - START )) s)"
log "passed: ${PASSED:- none}"
log "failed: ${FAILED:- none}"
log "skipped: ${SKIPPED:- none}"
[ -z "$FAILED" ]
