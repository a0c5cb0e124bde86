#!/usr/bin/env bash
# ThreadSanitizer run (docs/sanitizers.md): clang 14 builds the threads transport, both devices
# and the strategies with -fsanitize=thread into ./build-tsan (ccache when present), and runs
# the comm, device and strategy CTest entries: every strategy over the threads transport on
# the cpu and sim devices (the sim device's streams are worker threads of their own). MPI is
# off: OpenMPI is not instrumented, and its progress engine is opaque to TSan.
#
# OpenMP: one thread per rank (OMP_NUM_THREADS=1), the way the tests run; LLVM's libomp with
# its TSan annotation tool Archer (libarcher.so, from Debian's libomp-14-dev) when present, so
# that libomp's own synchronisation is visible to TSan and not reported as races.
#
#   scripts/tsan.sh                    # build and run comm, device, strategy
#   scripts/tsan.sh device             # some of them
#
# The test binaries run directly, not through ctest: their CTest TIMEOUTs (strategy: 180 s)
# are sized for the normal build, and TSan is 5-15x slower. Each gets an hour instead.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-tsan"
cxx="$(command -v clang++-14 || command -v clang++ || true)"
[ -n "$cxx" ] || { echo "tsan.sh: clang++ not found; install clang (scripts/setup.sh)" >&2; exit 2; }
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=thread -DHWY_COMPILE_ONLY_STATIC=1"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$flags" -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=thread" \
  -DCTXPAR_MPI=OFF -DCTXPAR_CUDA=OFF -DCTXPAR_DEV=OFF -DCTXPAR_FUZZ=OFF >/dev/null
cmake --build "$build" -j "$(getconf _NPROCESSORS_ONLN)" --target test_comm test_device test_strategy

export OMP_NUM_THREADS=1
archer="$(dirname "$(readlink -f "$cxx")")/../lib/libarcher.so"
[ -f "$archer" ] && export OMP_TOOL_LIBRARIES="$archer" ARCHER_OPTIONS="verbose=0"
# ignore_noninstrumented_modules: libomp itself is not instrumented (Archer annotates it).
export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:report_signal_unsafe=0:ignore_noninstrumented_modules=1"
# Not under TSan: ThreadsLimits.RefusedThreadIsAnErrorAndStopsTheStartedRanks caps the address
# space (RLIMIT_AS), which TSan's shadow memory cannot live under (an env override,
# CTXPAR_MEMORY_LIMIT_BYTES, replaces the cap; drop the name here then).
export GTEST_FILTER="-ThreadsLimits.RefusedThreadIsAnErrorAndStopsTheStartedRanks"
names=("$@")
[ ${#names[@]} -gt 0 ] || names=(comm device strategy)
rc=0
for n in "${names[@]}"; do
  case "$n" in comm|device|strategy) ;; *) echo "tsan.sh: unknown test '$n' (comm, device, strategy)" >&2; exit 2 ;; esac
  start=$SECONDS
  # The CTest entry's environment (tests/CMakeLists.txt, ctxpar_test_dir).
  if CTXPAR_BUILD_DIR="$build" CTXPAR_SOURCE_DIR="$root" timeout 3600 \
       "$build/tests/$n/test_$n" > "$build/$n.log" 2>&1; then
    echo "tsan.sh: $n passed in $((SECONDS - start)) s"
  else
    echo "tsan.sh: $n FAILED after $((SECONDS - start)) s; $build/$n.log ends:" >&2
    grep -E "WARNING: ThreadSanitizer|SUMMARY|FAILED|Failure" "$build/$n.log" | head -20 >&2
    tail -5 "$build/$n.log" >&2
    rc=1
  fi
done
exit $rc
