#!/usr/bin/env bash
# Installs, builds and runs the whole test suite: CTest, two entries at a time (the MPI, torchrun
# and timing entries alone: tests/CMakeLists.txt), then the Python package's tests (pytest,
# tests/python, two workers: pytest-xdist) under .venv's torch 2.15.0 from PyPI (torchrun jobs
# included), then a smoke subset under Debian's torch 1.13 (.venv-torch113, the same installed
# package). Prints each stage's wall time and the slowest entries at the end (scripts/stages.sh).
# Arguments go to ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/stages.sh
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
jobs=${CTXPAR_TEST_JOBS:-2}

run_ctest() {
  (cd build && ctest --output-on-failure --timeout 900 -j "$jobs" "$@") 2>&1 | tee "$(stage_log ctest-release)"
}
run_pytest() {
  .venv/bin/python -m pytest -q -n "$jobs" --durations=10 tests/python 2>&1 | tee "$(stage_log pytest)"
}
# The package as installed in .venv, alone on the path (not .venv's torch 2.15).
run_torch113() {
  local site
  site=$(.venv/bin/python -c "import ctxpar, os; print(os.path.dirname(os.path.dirname(ctxpar.__file__)))")
  mkdir -p build-python/torch113-path && ln -sfn "$site/ctxpar" build-python/torch113-path/ctxpar
  PYTHONPATH=$PWD/build-python/torch113-path .venv-torch113/bin/python -m pytest -q -p no:cacheprovider \
    tests/python/test_attention.py tests/python/test_boundary.py
}

stage setup bash scripts/setup.sh
stage build env CTXPAR_SETUP_DONE=1 bash scripts/build.sh
# The Python package ctxpar (docs/python.md): its library units are the Release build's, from
# ccache (CMakeLists.txt gives both builds the same keys; the compiler must be the same path too:
# scikit-build-core would take Python's own, g++, where the Release build has c++). A test build:
# with the extension's test hooks, which tests/python uses (python/bindings/testing.h).
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' build/CMakeCache.txt)
stage python-package env CXX="$cxx" .venv/bin/pip install -q --no-build-isolation \
  -C cmake.define.CTXPAR_PYTHON_TESTING=ON .
# The manylinux wheel over the same build (only the command links): tests/python/test_wheel.py
# installs it into a fresh venv with the -dev libraries hidden (docs/install.md).
wheel_rc=0
stage wheel env CXX="$cxx" bash scripts/wheel.sh -C cmake.define.CTXPAR_PYTHON_TESTING=ON ||
  wheel_rc=$?
rc=$wheel_rc
stage ctest run_ctest "$@" || rc=$?
stage pytest run_pytest || rc=$?
stage pytest-torch113 run_torch113 || rc=$?
stage_report
exit $rc
