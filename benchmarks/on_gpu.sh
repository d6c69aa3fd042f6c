#!/usr/bin/env bash
# Issue 12 on a GPU machine in one call (../shared/GPU.md): the gpu-marked tests, the dtype tests
# on the GPU, then the GPT-2-XL table (save_restore.py; async_gc.py in the time left), each under
# its own time limit. Logs and JSON go to $OUT (default ./gpu-out). Needs .whl/ with the wheels
# the machine lacks (zstandard, click, rich, hypothesis and their dependencies).
#   usage: bash benchmarks/on_gpu.sh [SECONDS_FOR_SAVE_RESTORE] [SECONDS_IN_ALL (default 570)]
set -u
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --target .site .whl/*.whl || exit 1
export PYTHONPATH=$PWD/.site:$PWD PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda,cpu
start=$SECONDS
phase() {  # phase NAME SECONDS COMMAND...: COMMAND with a time limit, logged to $OUT/NAME.log
    local name=$1 limit=$2; shift 2
    echo "== $name (limit ${limit}s) at $((SECONDS - start))s"
    timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: rc $? after $((SECONDS - start))s"; tail -n 40 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
phase gpu_tests 100 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_gpu.py
phase dtype_tests 60 python3 -m pytest -q -p no:cacheprovider --tb=line \
    tests/test_restore_dtypes.py tests/test_stored_dtype.py
phase save_restore "${1:-280}" python3 benchmarks/save_restore.py --size gpt2-xl --drop-caches \
    --systems casstore,orbax --json "$OUT/save_restore.json"
phase async_gc $(( ${2:-570} - (SECONDS - start) )) python3 benchmarks/async_gc.py \
    --size gpt2-xl --drop-caches --json "$OUT/async_gc.json"
