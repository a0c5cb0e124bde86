#!/usr/bin/env bash
# The prepared GPU check of the CUDA device (docs/cuda.md, "On a GPU"): one short run on one
# GPU (sized for under 8 minutes on an H200), never run yet. Writes what it finds under
# docs/data/gpu/ (and copies it to $OUT when that is set, for the device tool).
#   1. probe: driver (nvidia-smi), ctxpar --version (CUDA runtime, cuDNN, NCCL found), and the
#      real device-properties JSON that replaces the typed H200 one in the device-less check;
#   2. ctest -L cuda (host tile math; cuDNN graphs device-less) and -L gpu (ctxpar-cuda-check:
#      the fallback kernel on the GPU against the host tile math and the fp64 reference);
#   3. the cuDNN graphs again with the real driver: the plans now load.
# usage: scripts/gpu_check.sh [BUILD_DIR]     (default build-gpu; configured and built if needed)
set -uo pipefail
cd "$(dirname "$0")/.."
build=${1:-build-gpu}
data=docs/data/gpu
mkdir -p "$data"
log=$data/gpu_check.log
: > "$log"
say() { echo "== $*" | tee -a "$log"; }
step() {  # step NAME TIMEOUT_S COMMAND...: runs, logs, never stops the script
  local name=$1 limit=$2; shift 2
  say "$name: $*"
  timeout "$limit" "$@" >> "$log" 2>&1
  local rc=$?
  say "$name: exit $rc"
  return 0
}
export OMP_NUM_THREADS=1

say "probe"
step nvidia-smi 30 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
step nvidia-smi-full 30 nvidia-smi

if [ ! -f "$build/build.ninja" ]; then
  step configure 180 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCTXPAR_CUDA=ON
fi
[ -f third_party/cudnn_frontend/include/cudnn_frontend.h ] || say "cudnn-frontend headers missing (scripts/cudnn_frontend.sh needs PyPI): cuda_cudnn_graphs will fail"
step build 300 cmake --build "$build" -j "$(nproc)" --target ctxpar_cli test_cuda_tile \
  ctxpar_cuda_check cuda_cudnn_graphs
step version 30 "$build/ctxpar" --version
step save-properties 60 "$build/tests/cuda/cuda_cudnn_graphs" --save-properties "$data/device_properties.json"

say "tests"
step ctest-gpu 180 ctest --test-dir "$build" -L gpu --output-on-failure
step ctest-cuda 300 ctest --test-dir "$build" -L cuda --output-on-failure
# The device-less check used the stub driver; now the real one: plans build and load.
if [ -s "$data/device_properties.json" ]; then
  step cudnn-graphs-real-driver 240 "$build/tests/cuda/cuda_cudnn_graphs" "$data/device_properties.json"
fi
step cuda-device-refusal 30 "$build/ctxpar" attention --seq 256 --heads 2 --head-dim 16 --device cuda

say "done; log in $log"
if [ -n "${OUT:-}" ]; then cp -r "$data" "$OUT/"; fi
