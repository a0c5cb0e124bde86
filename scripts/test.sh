#!/usr/bin/env bash
# Installs, builds and runs the whole test suite (CTest; MPI tests under mpirun -n 2 and -n 4).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
cd build
ctest --output-on-failure --timeout 900 "$@"
