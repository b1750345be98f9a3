#!/usr/bin/env bash
# Wheels for a GPU machine that has no network but has torch (with numpy, scipy,
# matplotlib, pyyaml, tqdm, pytest): what petfunc and its metatrain extra need
# beside those, for one Python version, written to DIR. This is the set that ran
# the GPU tests and benchmarks/cuda_check.sh on an H200 (Python 3.12, torch 2.11);
# the versions are pinned because some must match each other (pydantic and
# pydantic-core, the metatensor family).
#
#     bash benchmarks/offline_wheels.sh DIR [PYTHON_VERSION]      # default 3.12
#
# then, on the GPU machine, from the checkout:
#
#     python3 -m pip install --no-index --no-deps --target /tmp/site DIR/*.whl
#     PYTHONPATH=/tmp/site PETFUNC_BENCH_DATA=... bash benchmarks/cuda_check.sh
#
# python-hostlist (imported by metatrain) is published as a source archive only: it
# is built into a wheel here (pure Python).
set -euo pipefail
dir=${1:?usage: offline_wheels.sh DIR [PYTHON_VERSION]}
version=${2:-3.12}
mkdir -p "$dir"
platforms=()
for p in manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux_2_24_x86_64 manylinux_2_27_x86_64 \
         manylinux_2_28_x86_64 manylinux_2_31_x86_64 manylinux_2_34_x86_64 manylinux_2_35_x86_64 any; do
    platforms+=(--platform "$p")
done
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$version" --implementation cp \
    "${platforms[@]}" -d "$dir" \
    ase==3.29.0 torchopt==0.7.3 optree==0.20.0 graphviz==0.21 typing_extensions==4.16.0 vesin==0.6.2 \
    metatrain==2026.4.1 metatensor-core==0.2.6 metatensor-torch==0.10.8 metatensor-operations==0.5.0 \
    metatensor-learn==0.5.0 metatomic-torch==0.1.19 metatomic-ase==0.1.4 torch-pme==0.5.0 wigners==0.4.1 \
    ctypes-dlpack==0.1.1 omegaconf==2.4.0 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 \
    typing-inspection==0.4.5 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 \
    rpds-py==2026.9.1
python3 -m pip wheel -q --no-deps -w "$dir" python-hostlist==2.3.0
ls "$dir"
