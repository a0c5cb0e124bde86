#!/usr/bin/env bash
# Installs the dependencies (Debian packages) and builds ctxpar into ./build (Release), through
# ccache when it is installed (scripts/setup.sh installs it): a rebuild of unchanged sources
# costs seconds. Its cache settings are ccache's own (CCACHE_DIR, CCACHE_MAXSIZE ...).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# ccache keys on paths relative to the clone, so a fresh clone elsewhere reuses the cache.
export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" >/dev/null
cmake --build build -j "$(nproc)"
