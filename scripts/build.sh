#!/usr/bin/env bash
# Installs the dependencies (Debian packages; scripts/setup.sh) and builds ctxpar into ./build
# (Release), through ccache when it is installed (setup.sh installs it): a rebuild of unchanged
# sources costs seconds. Its cache settings are ccache's own (CCACHE_DIR, CCACHE_MAXSIZE ...).
#
#   scripts/build.sh                   # everything: library, command, tests, kernel lab
#   scripts/build.sh --cxx ctxpar_cli  # only the command, with only its dependencies installed
#                                      # (setup.sh --cxx): what scripts/demo.sh runs
set -euo pipefail
cd "$(dirname "$0")/.."
setup=()
if [ "${1:-}" = "--cxx" ]; then setup=(--cxx); shift; fi
# CTXPAR_SETUP_DONE=1: the caller has just run setup.sh (scripts/test.sh times the two apart).
[ "${CTXPAR_SETUP_DONE:-0}" = 1 ] || bash scripts/setup.sh "${setup[@]}"
targets=()
for t in "$@"; do targets+=(--target "$t"); done
# ccache: CMakeLists.txt puts it in front of the compiler, keyed on paths relative to the clone.
cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build -j "$(getconf _NPROCESSORS_ONLN)" "${targets[@]}"
