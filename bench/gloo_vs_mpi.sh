#!/usr/bin/env bash
# gloo (torchrun) against MPI (mpirun) on the same problem, alternating runs, one rank per core:
#   bench/gloo_vs_mpi.sh [runs] [ctxpar] [torchrun]      (defaults: 5, build/ctxpar, torchrun
#                                                         of .venv-torch or CTXPAR_TORCHRUN)
# Prints each run's forward + backward seconds (the slowest rank's; JSON forward_seconds +
# backward_seconds), then the medians and gloo / MPI. docs/BENCHMARKS.md, "gloo vs MPI".
set -euo pipefail
runs=${1:-5}
ctxpar=$(realpath "${2:-build/ctxpar}")
torchrun=${3:-${CTXPAR_TORCHRUN:-$(dirname "$0")/../.venv-torch/bin/torchrun}}
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(attention --seq "${SEQ:-16384}" --heads 8 --head-dim 128 --mask causal --layout zigzag
      --strategy ring --backward --threads 1 --json)
seconds() { python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["forward_seconds"] + j["backward_seconds"])'; }
gloo=() mpi=()
for i in $(seq "$runs"); do
  m=$(mpirun -n 2 --bind-to core --mca btl self,vader,tcp "$ctxpar" "${args[@]}" | seconds)
  # torchrun does not bind: each rank pins itself to the core of its LOCAL_RANK.
  g=$("$torchrun" --no-python --standalone --nproc-per-node 2 \
        sh -c 'exec taskset -c "$LOCAL_RANK" "$0" "$@"' "$ctxpar" "${args[@]}" 2>/dev/null | seconds)
  echo "run $i: mpi $m s, gloo $g s (load $(cut -d' ' -f1 /proc/loadavg))"
  mpi+=("$m") gloo+=("$g")
done
python3 - "${mpi[*]}" "${gloo[*]}" <<'PY'
import statistics, sys
m = statistics.median(map(float, sys.argv[1].split()))
g = statistics.median(map(float, sys.argv[2].split()))
print(f"median: mpi {m:.3f} s, gloo {g:.3f} s, gloo / mpi = {g / m:.3f}")
PY
