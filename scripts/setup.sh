#!/usr/bin/env bash
# Installs every dependency of ctxpar from Debian's packages. Idempotent: a package that is
# already installed is skipped, so a second run costs a few seconds.
set -euo pipefail
pkgs=(
  build-essential cmake ninja-build pkg-config
  libgtest-dev libgmock-dev
  libhwy-dev libopenblas-dev
  libopenmpi-dev openmpi-bin
  nlohmann-json3-dev
  python3-numpy python3-matplotlib python3-torch
  clang libclang-rt-14-dev
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
