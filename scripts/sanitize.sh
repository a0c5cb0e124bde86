#!/usr/bin/env bash
# The sanitizer stage of CI (.ci/run calls it after the normal suite; docs/sanitizers.md):
#
#   1. ASan + UBSan: GCC builds the library, the command and the tests into ./build-asan
#      (-O2 -g -fsanitize=address,undefined, -march=native; any UB or leak ends the test) and runs the
#      strategy, comm, device, kernel (one SIMD target), io, cli, inference and MPI CTest entries.
#   2. The libFuzzer targets (scripts/fuzzers.sh: safetensors, mask, npy, npy_rows, options),
#      each a bounded run over its committed corpus fuzz/corpus/<target>/.
#
#   scripts/sanitize.sh                 # both stages (what CI runs)
#   scripts/sanitize.sh --only asan     # or --only fuzz
#   scripts/sanitize.sh -- -R '^io$'    # ctest arguments after -- (replace the entry list)
#
# Exits non-zero when a test fails or a fuzz target crashes; both stages always run, so one
# log shows every finding. ccache makes a second build cost seconds (set up by
# CMakeLists.txt).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
only=""
ctest_args=()
while [ $# -gt 0 ]; do
  case "$1" in
    --only) only="$2"; shift 2 ;;
    --) shift; ctest_args=("$@"); break ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "sanitize.sh: unknown argument '$1' (--only asan|fuzz, -- CTEST-ARGS)" >&2; exit 2 ;;
  esac
done
case "$only" in ""|asan|fuzz) ;; *) echo "sanitize.sh: --only takes asan or fuzz, not '$only'" >&2; exit 2 ;; esac

source "$root/scripts/stages.sh"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
rc=0

asan_stage() {
  local build="$root/build-asan"
  local cxx; cxx="$(command -v g++-12 || command -v g++)"
  # CMAKE_BUILD_TYPE=None: exactly these flags (asserts on). -march=native with
  # HWY_COMPILE_ONLY_STATIC: the kernel is compiled once, for the best SIMD target of the machine
  # that runs the tests (AVX-512 or AVX2 here), not five times: a third of the build, and the
  # attention runs of the cli and strategy entries are not slowed by a 4-wide SSE4 kernel at -O1
  # (docs/sanitizers.md has the timings; the normal suite tests every target: kernel_*).
  local flags="-O2 -g1 -fno-omit-frame-pointer -fsanitize=address,undefined"
  flags+=" -fno-sanitize-recover=undefined -DHWY_COMPILE_ONLY_STATIC=1"
  # CMAKE_UNITY_BUILD: eight sources a translation unit, so each header is parsed and each
  # inline function instrumented once per eight (the Highway kernels stay alone:
  # src/CMakeLists.txt); the normal build compiles every file alone, so a file that leans on
  # another's includes still fails there (docs/sanitizers.md has the timings).
  # CTXPAR_CUDA=OFF: the CUDA parts cannot run here, and the cuDNN frontend's one translation
  # unit costs minutes to compile a second time; the normal suite builds and tests them
  # (ctest -L cuda, CliCuda.* with and without CUDA: tests/cli/cuda_device_test.cc).
  cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
    -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$flags" \
    -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
    -DCMAKE_UNITY_BUILD=ON -DCMAKE_UNITY_BUILD_BATCH_SIZE=8 \
    -DCTXPAR_ARCH=native -DCTXPAR_CUDA=OFF -DCTXPAR_DEV=OFF -DCTXPAR_FUZZERS=OFF -DCTXPAR_TEST_TIMEOUT_SCALE=4 >/dev/null
  local targets=(ctxpar_cli test_strategy test_strategy_mpi test_comm test_comm_mpi test_device
                 test_kernel test_io test_cli test_cli_io test_mpi test_inference test_inference_mpi)
  stage asan-build cmake --build "$build" -j "$(getconf _NPROCESSORS_ONLN)" --target "${targets[@]}" || { rc=1; return; }

  # Leaks: OpenMPI keeps its own allocations to exit (scripts/lsan.supp says which); its
  # reports need full stacks to match, hence fast_unwind_on_malloc=0.
  export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0:fast_unwind_on_malloc=0:strict_string_checks=1:detect_stack_use_after_return=1:check_initialization_order=1"
  export LSAN_OPTIONS="suppressions=$root/scripts/lsan.supp:print_suppressions=0"
  export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
  # Tests that cap the address space (ulimit -v / RLIMIT_AS) skip themselves under a sanitizer
  # (tests/sanitizers.h: ASan reserves terabytes of shadow memory); the memory checks they guard
  # run here through CTXPAR_MEMORY_LIMIT_BYTES instead.
  if [ ${#ctest_args[@]} -eq 0 ]; then
    # kernel_best: the one SIMD target built. Not run: mpi_net_overlap and mpi_net_plan
    # (overlap timings over a shaped link; ASan's 2-5x slowdown is what they would measure).
    # inference: a test of it read past a tensor for a round unseen (docs/sanitizers.md).
    ctest_args=(-R '^(strategy|strategy_mpi_[0-9]+|comm|comm_mpi_.*|device|kernel_best|io|cli|cli_io|cli_mpi|inference|inference_mpi_2|mpi_(n|thread_n|fault_n|cli_n)[0-9]+|mpi_plan_local_cp_mismatch)$')
  fi
  stage asan-ctest run_asan_ctest "$build" || rc=1
}

# Two entries at a time, as the Release suite (tests/CMakeLists.txt says which run alone).
run_asan_ctest() {
  (cd "$1" && ctest --output-on-failure --timeout 1200 -j "${CTXPAR_TEST_JOBS:-2}" "${ctest_args[@]}") 2>&1 |
    tee "$(stage_log ctest-asan)"
}

fuzz_stage() {
  stage fuzz bash "$root/scripts/fuzzers.sh" --runs || rc=1
}

[ "$only" != fuzz ] && asan_stage
[ "$only" != asan ] && fuzz_stage
stage_report
exit $rc
