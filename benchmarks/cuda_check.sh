#!/usr/bin/env bash
# The checks that need a CUDA device, in one run (for a GPU machine lent for minutes):
#   1. tests/test_cuda.py, slow ones included (inductor on CUDA): CPU == CUDA, metatrain's
#      gradients on CUDA, compiled == eager with one graph, ensembles, Hessians, the
#      ASE calculator, `petfunc train` and `petfunc export` on the device;
#   2. benchmarks/train_step.py --device cuda on qm9 and on carbon, each dataset in its
#      own process (cold compiles), with metatrain's step where metatrain imports;
#   3. benchmarks/ddp.py on NCCL (RUN_DDP=0 leaves it out).
# Each stage has its own time limit, so that one that hangs or fails leaves the others
# their time. Logs go to LOGDIR (default cuda_logs/).
#
#     bash benchmarks/cuda_check.sh [LOGDIR]
#
# Environment: RUN_TESTS (0: benchmarks only), TEST_TIMEOUT (s, default 220),
# BENCH_TIMEOUT (s per dataset, default 170), STEPS (timed steps per dataset, default
# 20), DDP_TIMEOUT (s, default 90), PETFUNC_BENCH_DATA (the datasets' folder, see train_step.py).
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

if [ "${RUN_TESTS:-1}" = 1 ]; then
stamp "tests/test_cuda.py"
timeout "${TEST_TIMEOUT:-220}" $python -m pytest tests/test_cuda.py -v -p no:cacheprovider -W ignore::DeprecationWarning --durations=12 \
    2>&1 | tee "$logs/tests.log"
stamp "tests done (exit ${PIPESTATUS[0]})"
fi

for dataset in qm9 carbon; do
    stamp "benchmark $dataset"
    TORCHINDUCTOR_CACHE_DIR=$(mktemp -d) PETFUNC_TRACE_CACHE=0 timeout "${BENCH_TIMEOUT:-170}" \
        $python benchmarks/train_step.py --dataset "$dataset" --device cuda --steps "${STEPS:-20}" \
        --variants "${variants[@]}" 2>&1 | tee "$logs/bench_$dataset.log"
    stamp "benchmark $dataset done (exit ${PIPESTATUS[0]})"
done

if [ "${RUN_DDP:-1}" = 1 ]; then
    # data parallel on NCCL, 1..#GPUs processes (tests/test_distributed.py checks the
    # exactness on CPU/gloo in the default suite)
    stamp "benchmark ddp"
    timeout "${DDP_TIMEOUT:-90}" $python benchmarks/ddp.py --device cuda --steps 10 --warmup 2 --batch 16 \
        2>&1 | tee "$logs/bench_ddp.log"
    stamp "benchmark ddp done (exit ${PIPESTATUS[0]})"
fi
