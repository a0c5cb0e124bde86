#!/usr/bin/env bash
# Decode's merge across ranks (KvCacheOptions::merge: allgather, chain, tree), each timed on the
# job's own ranks by `ctxpar decode --merge auto` (time_decode_merges: 20 merges each, the
# slowest rank's mean), for P = 2..8 on the threads transport and under mpirun.
#   bench/decode_merge.sh [CTXPAR] [-- extra decode args]
# Prints one row per (transport, P): microseconds per merge and the fastest.
set -euo pipefail
ctxpar=${1:-build/ctxpar}
shift || true
[ "${1:-}" = "--" ] && shift
extra=("$@")
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
args=(decode --context 4096 --tokens 2 --heads 8 --kv-heads 2 --head-dim 128 --json "${extra[@]}")
row() {
  python3 -c '
import json, sys
j = json.loads(sys.stdin.read().strip().splitlines()[-1])
m = j["merge_seconds_measured"]
best = min(m, key=m.get)
print(f"| {sys.argv[1]} | {sys.argv[2]} | " + " | ".join(f"{m[k]*1e6:.0f}" for k in ("allgather", "chain", "tree")) + f" | {best} |")
' "$1" "$2"
}
echo "| transport | P | allgather (us) | chain (us) | tree (us) | fastest |"
echo "|---|---|---|---|---|---|"
for p in 2 3 4 5 6 7 8; do
  "$ctxpar" "${args[@]}" --ranks "$p" | row threads "$p"
done
if command -v mpirun >/dev/null; then
  for p in 2 3 4 5 6 7 8; do
    mpirun -n "$p" --oversubscribe --mca btl_vader_single_copy_mechanism none \
      "$ctxpar" "${args[@]}" | row mpi "$p"
  done
fi
