#!/usr/bin/env bash
# Installs, builds and runs the demo: causal attention over 65,536 tokens split across 4 ranks
# (threads transport) with the zigzag ring, forward and backward, checked against the fp64
# reference, with the per-rank table and the memory one rank would have needed alone.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
.venv/bin/pip install -q --no-build-isolation .   # the Python package ctxpar (docs/python.md)
exec ./build/ctxpar attention --seq 65536 --heads 4 --head-dim 64 --ranks 4 \
  --strategy ring --layout zigzag --mask causal --backward --check "$@"
