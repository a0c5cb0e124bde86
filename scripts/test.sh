#!/usr/bin/env bash
# Installs, builds and runs the whole test suite: CTest (MPI tests under mpirun -n 2 and -n 4),
# then the Python package's tests (pytest, tests/python) under .venv's torch 2.15.0 from PyPI
# (torchrun jobs included), then a smoke subset under Debian's torch 1.13 (.venv-torch113, the
# same installed package). Arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/build.sh
.venv/bin/pip install -q --no-build-isolation .   # the Python package ctxpar (docs/python.md)
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
rc=0
(cd build && ctest --output-on-failure --timeout 900 "$@") || rc=$?
.venv/bin/python -m pytest -q tests/python || rc=$?
# The package as installed in .venv, alone on the path (not .venv's torch 2.15).
site=$(.venv/bin/python -c "import ctxpar, os; print(os.path.dirname(os.path.dirname(ctxpar.__file__)))")
mkdir -p build-python/torch113-path && ln -sfn "$site/ctxpar" build-python/torch113-path/ctxpar
PYTHONPATH=$PWD/build-python/torch113-path .venv-torch113/bin/python -m pytest -q -p no:cacheprovider \
  tests/python/test_attention.py tests/python/test_boundary.py || rc=$?
exit $rc
