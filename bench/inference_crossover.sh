#!/usr/bin/env bash
# Prefill of 4096 new tokens onto caches of C tokens, pass-KV against pass-Q, for a range of C
# (the planner's crossover against the measured one; docs/BENCHMARKS.md, "Inference").
# mpirun -n 2, one rank per core; each C alternates the two modes for two rounds
# (bench/inference_prefill.py), and `ctxpar decode --plan` predicts the same shape.
# Usage: bench/inference_crossover.sh [build dir] (PYTHON: the venv's python, with ctxpar).
set -euo pipefail
build=${1:-build}
py=${PYTHON:-.venv/bin/python}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
lscpu | grep 'Model name'
for cached in 0 4096 16384 65536 126976; do
  uptime
  "$build/ctxpar" decode --plan --context $((cached + 4096)) --chunk 4096 --ranks 2 --heads 2 \
    --kv-heads 1 --head-dim 64 --json
  mpirun -n 2 --oversubscribe "$py" bench/inference_prefill.py --cached "$cached" --new 4096 --rounds "${ROUNDS:-2}"
done
uptime
