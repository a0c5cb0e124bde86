#!/usr/bin/env bash
# Installs what the command needs (Debian packages: scripts/setup.sh --cxx), builds only the
# `ctxpar` command (not the tests, the kernel lab or the Python package: the demo uses none of
# them) and runs the demo: causal attention over 65,536 tokens split across 4 ranks (threads
# transport) with the zigzag ring, forward and backward, checked against the fp64 reference, with
# the per-rank table and the memory one rank would have needed alone. Arguments go to the command.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
bash scripts/build.sh --cxx ctxpar_cli
echo "demo: installed and built in $((SECONDS - start)) s; running" >&2
exec ./build/ctxpar attention --seq 65536 --heads 4 --head-dim 64 --ranks 4 \
  --strategy ring --layout zigzag --mask causal --backward --check "$@"
