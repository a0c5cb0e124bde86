#!/usr/bin/env bash
# Inference benchmarks (docs/BENCHMARKS.md, "Inference"): decode per-token time at 128K and 1M
# context, P = 1 and 2 (threads, one rank per core), alternating, with each rank's CPU time;
# the planner's predictions; prefill of 4K tokens onto a 128K cache, pass-KV against pass-Q
# (mpirun -n 2). Usage: bench/inference.sh [build dir] (the venv's python for the prefill).
set -euo pipefail
build=${1:-build}
ctxpar=$build/ctxpar
py=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
lscpu | grep 'Model name'
shape=(--heads 8 --kv-heads 1 --head-dim 128)
for context in 128K 1M; do
  tokens=$([[ $context == 1M ]] && echo 4 || echo 16)
  rounds=$([[ $context == 1M ]] && echo 1 || echo 2)
  for round in $(seq "$rounds"); do
    for p in 1 2; do
      uptime
      "$ctxpar" decode --context $context --ranks $p --tokens "$tokens" --prefill fill \
        "${shape[@]}" --json
    done
  done
  for p in 1 2 4 8; do
    "$ctxpar" decode --plan --context $context --ranks $p "${shape[@]}" --json
  done
done
uptime
"$ctxpar" decode --plan --context 131072 --chunk 4096 --ranks 2 --heads 2 --kv-heads 1 \
  --head-dim 64 --json
mpirun -n 2 --oversubscribe "$py" bench/inference_prefill.py --cached 126976 --new 4096
uptime
