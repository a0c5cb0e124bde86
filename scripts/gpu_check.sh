#!/usr/bin/env bash
# The prepared GPU check of the CUDA device (docs/cuda.md, "On a GPU"): one run on one GPU,
# sized for under 8 minutes on an H200, never run yet. It probes before it tests, every step
# has a timeout, and the whole script keeps to a deadline (CTXPAR_GPU_CHECK_BUDGET seconds,
# default 470): a step starts only with time left and gets at most that. Writes what it finds
# under docs/data/gpu/ (and copies it to $OUT when that is set, for the device tool).
#   1. probe: driver and GPU (nvidia-smi), ctxpar --version (CUDA runtime, cuDNN, NCCL found),
#      torch's view (versions, cuDNN), and the real device-properties JSON that replaces the
#      typed H200 one in the device-less check;
#   2. ctest -L gpu (ctxpar-cuda-check: the fallback kernel against the host tile math and the
#      fp64 reference), the cuDNN graphs with the real driver;
#   3. the correctness grid on the loopback transport (bench/gpu_cli.py grid -> grid.json):
#      strategy x layout x mask x P in {1,2,4,8}, fp32 and bf16, forward and backward, against
#      the fp64 CPU reference; the error must not grow with P;
#   4. benchmarks: (a) one rank against torch's SDPA backends (bench/gpu_sdpa.py -> sdpa.json),
#      (b) P = 4 and 8 loopback ranks against one (scaling.json), (c) the longest causal
#      sequence the loopback ring runs on this GPU (longest.json).
# Without a GPU it says so and exits 77 within seconds, before building anything.
# It builds on the GPU machine, which needs that machine to have the build's dependencies (the
# Debian -dev packages of scripts/setup.sh, a package registry): where it has not, as on the
# machine described in ../shared/GPU-NOTES.md, use scripts/gpu_bundle.sh here and
# scripts/gpu_first.sh there instead (docs/cuda.md, "The first GPU window").
# usage: scripts/gpu_check.sh [BUILD_DIR]     (default build-gpu; configured and built if needed)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
. scripts/gpu_lib.sh
build=${1:-build-gpu}
data=docs/data/gpu
budget=${CTXPAR_GPU_CHECK_BUDGET:-470}
start=$SECONDS
failures=0

# ---- is there a GPU? (seconds, nothing built) ----
gpu=$(gpu_found)
if [ -z "$gpu" ]; then
  echo "gpu_check: no GPU here: $(gpu_absent_reason); nothing was built or run. Run this script on a machine with an NVIDIA GPU and its driver (docs/cuda.md, \"On a GPU\")." >&2
  exit 77
fi

mkdir -p "$data"
log=$data/gpu_check.log
: > "$log"
export GPU_LOG=$log GPU_MIN_START=10
gpu_deadline "$budget"
say() { echo "== $*" | tee -a "$log"; }
cap() { local n=$(($(gpu_left) - 15)); [ "$1" -lt "$n" ] && n=$1; [ "$n" -lt 1 ] && n=1; echo "$n"; }  # a run's own budget
step() {  # step NAME TIMEOUT_S COMMAND...: gpu_step (gpu_lib.sh), logged; never stops the script
  gpu_step "$@"
  echo "== $1: $GPU_STATUS after $((SECONDS - start)) s"
  [ "$GPU_STATUS" = passed ] || failures=$((failures + 1))
  return 0
}
export OMP_NUM_THREADS=1
py=python3
[ -x .venv/bin/python ] && py=.venv/bin/python

say "probe: $gpu"
step nvidia-smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
step torch 30 "$py" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version(), 'nccl', torch.cuda.nccl.version(), torch.cuda.get_device_name(0))"

if [ ! -f "$build/build.ninja" ]; then
  step configure 90 cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCTXPAR_CUDA=ON
fi
[ -f third_party/cudnn_frontend/include/cudnn_frontend.h ] || say "cudnn-frontend headers missing (scripts/cudnn_frontend.sh needs PyPI): cuda_cudnn_graphs will fail"
step build 200 cmake --build "$build" -j "$(getconf _NPROCESSORS_ONLN)" --target ctxpar_cli ctxpar_cuda_check \
  test_cuda_nccl cuda_cudnn_graphs
step version 20 "$build/ctxpar" --version
step save-properties 30 "$build/tests/cuda/cuda_cudnn_graphs" --save-properties "$data/device_properties.json"

say "tests"
step ctest-gpu 60 ctest --test-dir "$build" -L gpu --output-on-failure
step ctest-nccl 30 ctest --test-dir "$build" -R cuda_nccl --output-on-failure
if [ -s "$data/device_properties.json" ]; then  # the real driver: plans build and load
  step cudnn-graphs-real-driver 60 "$build/tests/cuda/cuda_cudnn_graphs" "$data/device_properties.json"
fi

say "correctness grid (loopback, fp64 reference)"
step grid 100 "$py" bench/gpu_cli.py grid "$build/ctxpar" "$data/grid.json" "$(cap 90)"

say "benchmarks"
step sdpa 90 "$py" bench/gpu_sdpa.py "$data/sdpa.json" "$(cap 80)"
step scaling 45 "$py" bench/gpu_cli.py scaling "$build/ctxpar" "$data/scaling.json" "$(cap 40)"
step longest 40 "$py" bench/gpu_cli.py longest "$build/ctxpar" "$data/longest.json" "$(cap 35)"

say "done after $((SECONDS - start)) s, ${failures} step(s) failed or not run; log in $log"
if [ -n "${OUT:-}" ]; then cp -r "$data" "$OUT/"; fi
[ "$failures" -eq 0 ]
