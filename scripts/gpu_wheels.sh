#!/usr/bin/env bash
# Build .whl/, the wheels the GPU machine lacks, for its Python 3.12 (issue 33; run here, where PyPI is reachable).
# The device image has torch 2.11 (CUDA 13), accelerate, peft, safetensors, pytest, pandas, pyarrow, xxhash, fsspec;
# it lacks datasets, math-verify and TRL, and holds transformers 5.17 (the project pins 5.19). All of these are pure
# Python wheels, about 15 MB together (the device tool carries at most 64 MiB). vLLM cannot travel: it brings its own
# torch, so the `gpu and vllm` tests stay for a machine that has it.
set -euo pipefail
cd "$(dirname "$0")/.."
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
rm -rf .whl && mkdir .whl
WHEELS=(
    transformers==5.19.0 peft==0.21.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
    math-verify==0.9.0 latex2sympy2-extended==1.11.0 antlr4-python3-runtime==4.13.2
    trl==1.16.0
)
# datasets 5.2 needs pyarrow >= 24; the device image's pyarrow was not read. WITH_PYARROW=1 adds its wheel (~40 MB).
[ "${WITH_PYARROW:-0}" = 1 ] && WHEELS+=(pyarrow==26.0.1)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any -d .whl "${WHEELS[@]}"
du -sh .whl
ls .whl
