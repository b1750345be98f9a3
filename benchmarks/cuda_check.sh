#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (for a GPU machine lent for minutes):
#   1. tests/gpu/test_cuda.py, slow ones included (inductor on CUDA): CPU == CUDA, metatrain's
#      gradients on CUDA, compiled == eager with one graph, ensembles, Hessians, the
#      ASE calculator (long-range too), `petfunc train` and `petfunc export` on the
#      device; at the same time benchmarks/ddp.py on NCCL (RUN_DDP=0 leaves it out;
#      its numbers are then not quiet ones, it is there to run NCCL at all);
#   2. benchmarks/train_step.py --device cuda --profile on qm9 and on carbon, each
#      dataset in its own process (cold compiles), with metatrain's step where
#      metatrain imports;
#   3. for each variant named in BENCH_EXTRA (say "compiled cpp_wrapper"), qm9 again
#      in a process of its own with metatrain's step and that variant;
#   4. the AOTInductor export test for the GPU, alone (it crashed its process once).
# Each stage has its own time limit, so that one that hangs or fails leaves the others
# their time. Logs go to LOGDIR (default cuda_logs/).
#
#     bash benchmarks/cuda_check.sh [LOGDIR]
#
# On a machine without network access, install the wheels of
# benchmarks/offline_wheels.sh first (torch itself must be there already).
#
# Environment: RUN_TESTS (0: benchmarks only), TEST_TIMEOUT (s, default 220),
# AOTI_TIMEOUT (s, the CUDA AOTInductor export test alone, default 200),
# TEST_WORKERS (pytest-xdist processes where it is installed, default 6),
# BENCH_TIMEOUT (s per dataset, default 170), STEPS (timed steps per dataset, default
# 20), DDP_TIMEOUT (s, default 90), DATASETS (of 2., default "qm9 carbon"; empty: none),
# BENCH_EXTRA (see 3.), PETFUNC_BENCH_DATA (the datasets' folder, see train_step.py).
# With minutes of device time, the one number still missing first (inductor's C++
# wrapper on the GPU, qm9):
#     RUN_TESTS=0 RUN_DDP=0 DATASETS= BENCH_EXTRA="compiled cpp_wrapper" BENCH_TIMEOUT=400 \
#         bash benchmarks/cuda_check.sh
set -u
cd "$(dirname "$0")/.."
logs=${1:-cuda_logs}
mkdir -p "$logs"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python=${PYTHON:-python3}

stamp() { echo "## $(date -u +%H:%M:%S) $*"; }

stamp "device" | tee "$logs/device.txt"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$logs/device.txt"
$python -c "import torch, os; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cpus', os.cpu_count())" 2>&1 | tee -a "$logs/device.txt"

variants=(metatrain eager "eager func" compiled)
if ! $python -c "import metatrain.pet, metatomic.torch" >>"$logs/device.txt" 2>&1; then
    echo "metatrain does not import: benchmarks without its step" | tee -a "$logs/device.txt"
    variants=(eager "eager func" compiled)
fi

ddp_pid=
if [ "${RUN_DDP:-1}" = 1 ]; then
    # data parallel on NCCL, 1..#GPUs processes (tests/distributed/ checks the
    # exactness on CPU/gloo in the default suite)
    stamp "benchmark ddp (in the background)"
    ( timeout "${DDP_TIMEOUT:-90}" $python benchmarks/ddp.py --device cuda --steps 10 --warmup 2 --batch 16 \
        >"$logs/bench_ddp.log" 2>&1; echo "## $(date -u +%H:%M:%S) benchmark ddp done (exit $?)" >>"$logs/bench_ddp.log" ) &
    ddp_pid=$!
fi

if [ "${RUN_TESTS:-1}" = 1 ]; then
stamp "tests/gpu/test_cuda.py"
workers=()
if $python -c "import xdist" 2>/dev/null && [ "${TEST_WORKERS:-6}" -gt 1 ]; then
    # a crashed worker is not replaced: its replacement would hold the GPU until the time limit
    workers=(-n "${TEST_WORKERS:-6}" --max-worker-restart 0)
fi
timeout "${TEST_TIMEOUT:-220}" $python -m pytest tests/gpu/test_cuda.py -m "" -v -p no:cacheprovider -W ignore::DeprecationWarning \
    --durations=20 "${workers[@]}" 2>&1 | tee "$logs/tests.log"
stamp "tests done (exit ${PIPESTATUS[0]})"
fi

if [ -n "$ddp_pid" ]; then
    wait "$ddp_pid"
    cat "$logs/bench_ddp.log"
fi

bench() {  # bench LOGNAME DATASET VARIANT...
    local log=$1 dataset=$2
    shift 2
    stamp "benchmark $log"
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PETFUNC_TRACE_CACHE=0 timeout "${BENCH_TIMEOUT:-170}" \
        $python benchmarks/train_step.py --dataset "$dataset" --device cuda --steps "${STEPS:-20}" --profile \
        --variants "$@" 2>&1 | tee "$logs/bench_$log.log"
    stamp "benchmark $log done (exit ${PIPESTATUS[0]})"
}

for dataset in ${DATASETS-qm9 carbon}; do
    bench "$dataset" "$dataset" "${variants[@]}"
done
if [ -n "${BENCH_EXTRA:-}" ]; then
    IFS=, read -r -a extras <<<"$BENCH_EXTRA"
    for extra in "${extras[@]}"; do
        base=()
        [ "${variants[0]}" = metatrain ] && base=(metatrain)
        bench "qm9_${extra// /_}" qm9 "${base[@]}" "$extra"
    done
fi

if [ "${RUN_TESTS:-1}" = 1 ]; then
# the AOTInductor export for the GPU crashed its loading process on an H200 (torch
# 2.11): last, alone, in a process of its own, so that a crash costs nothing else
stamp "tests/gpu/test_cuda.py AOTInductor export"
PETFUNC_TRY_CUDA_AOTI=1 timeout "${AOTI_TIMEOUT:-200}" $python -X faulthandler -m pytest \
    "tests/gpu/test_cuda.py::test_export_equals_eager[aoti]" -m "" -v -p no:cacheprovider -W ignore::DeprecationWarning \
    2>&1 | tee "$logs/tests_aoti.log"
stamp "AOTInductor export test done (exit ${PIPESTATUS[0]})"
fi
