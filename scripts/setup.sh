#!/usr/bin/env bash
# Installs every dependency of ctxpar from Debian's packages, and .venv: a virtual environment
# of Debian's python3 that sees Debian's torch, numpy and mpi4py (--system-site-packages), with
# the Python package's build tools from PyPI (docs/python.md says why). Idempotent: what is
# already installed is skipped, so a second run costs a few seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=(
  build-essential cmake ninja-build pkg-config ccache
  libgtest-dev libgmock-dev
  libhwy-dev libopenblas-dev
  libopenmpi-dev openmpi-bin
  nlohmann-json3-dev
  python3-numpy python3-matplotlib python3-torch
  python3-dev python3-venv python3-mpi4py
  clang libclang-rt-14-dev libomp-14-dev
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

[ -x .venv/bin/python ] || /usr/bin/python3 -m venv --system-site-packages .venv
.venv/bin/python -c "import scikit_build_core, nanobind, pytest" 2>/dev/null ||
  .venv/bin/pip install -q "scikit-build-core>=0.10" "nanobind>=2.0" pytest

# The CUDA device's cuDNN graph check (ctest -L cuda) needs cudnn-frontend's headers, from PyPI
# into third_party/ (not committed). Where the download fails, that check fails saying so.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  scripts/cudnn_frontend.sh || echo "setup.sh: cudnn-frontend not fetched; ctest -L cuda will fail until it is" >&2
fi
