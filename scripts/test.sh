#!/usr/bin/env bash
# Installs, builds and runs the whole test suite: CTest (MPI tests under mpirun -n 2 and -n 4),
# then the Python package's tests (pytest, tests/python). Arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
.venv/bin/pip install -q --no-build-isolation .   # the Python package ctxpar (docs/python.md)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
rc=0
(cd build && ctest --output-on-failure --timeout 900 "$@") || rc=$?
.venv/bin/python -m pytest -q tests/python || rc=$?
exit $rc
