#!/usr/bin/env bash
# Builds the libFuzzer targets (fuzz/*_fuzz.cc; docs/sanitizers.md) with clang 14, ASan and
# UBSan into ./build-fuzzers (CMake, -DCTXPAR_FUZZERS=ON; ccache when present) and runs them:
#
#   scripts/fuzzers.sh --runs                 # CI: every target, a fixed number of runs from
#                                             # a fixed seed over its corpus (<= 60 s each)
#   scripts/fuzzers.sh --seconds 600 safetensors mask   # longer runs of some targets
#   scripts/fuzzers.sh --build-only
#   scripts/fuzzers.sh --seconds 3600 npy -- -jobs=2 -workers=2   # libFuzzer flags after --
#
# Targets: npy (parse_npy, read_npy), npy_rows (read_npy_rows), safetensors (read_safetensors),
# mask (--mask and documents:len,...), options (the command-line parser). Each reads
# fuzz/corpus/<target>/ (committed seeds, never written), fuzz/regressions/<target>/ (inputs
# that crashed it once: replayed every run) and BUILD/corpus-<target>/ (new inputs).
# A crash leaves BUILD/crash-<target>-<hash> and makes this script exit 1 after every target
# ran. Reproduce one with: BUILD/fuzz/<target>_fuzz BUILD/crash-<target>-<hash>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzzers"
all=(npy npy_rows safetensors mask options)
mode=""
seconds=60
targets=()
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --runs) mode=runs; shift ;;
    --seconds) mode=seconds; seconds="$2"; shift 2 ;;
    --build-only) mode=build; shift ;;
    --build-dir) build="$2"; shift 2 ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    -*) echo "fuzzers.sh: unknown option '$1' (--runs, --seconds N, --build-only, --build-dir DIR)" >&2; exit 2 ;;
    *) [[ " ${all[*]} " == *" $1 "* ]] || { echo "fuzzers.sh: unknown target '$1' (${all[*]})" >&2; exit 2; }
       targets+=("$1"); shift ;;
  esac
done
[ -n "$mode" ] || { echo "fuzzers.sh: give --runs, --seconds N or --build-only (--help)" >&2; exit 2; }
[ ${#targets[@]} -gt 0 ] || targets=("${all[@]}")
cxx="$(command -v clang++-14 || command -v clang++ || true)"
[ -n "$cxx" ] || { echo "fuzzers.sh: clang++ not found; install clang and libclang-rt-14-dev (scripts/setup.sh)" >&2; exit 2; }

# The library with fuzzer-no-link (coverage for libFuzzer, no main); only the targets link
# libFuzzer. -O1 -g: reports with line numbers. No -march=native, and one SIMD target
# (HWY_COMPILE_ONLY_STATIC: no parser touches the kernel), so a crash file replays anywhere.
# No MPI: nothing fuzzed here talks to other ranks. No CUDA: nothing fuzzed runs on a GPU, and the
# cuDNN frontend's translation unit would cost minutes under clang.
flags="-O1 -g -fno-omit-frame-pointer -fsanitize=fuzzer-no-link,address,undefined"
flags+=" -fno-sanitize-recover=undefined -DHWY_COMPILE_ONLY_STATIC=1"
cmake -S "$root" -B "$build" -G Ninja -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" \
  -DCTXPAR_FUZZERS=ON -DCTXPAR_TESTS=OFF -DCTXPAR_DEV=OFF -DCTXPAR_MPI=OFF -DCTXPAR_CUDA=OFF >/dev/null
cmake --build "$build" -j "$(getconf _NPROCESSORS_ONLN)" --target "${targets[@]/%/_fuzz}"
[ "$mode" = build ] && exit 0

export ASAN_OPTIONS="halt_on_error=1:detect_leaks=1:abort_on_error=0"
export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
rc=0
for t in "${targets[@]}"; do
  mkdir -p "$build/corpus-$t"
  args=(-rss_limit_mb=2048 -timeout=10 -print_final_stats=1 -artifact_prefix="$build/crash-$t-")
  case "$t" in
    npy|npy_rows) args+=(-dict="$root/fuzz/npy.dict" -max_len=4096) ;;
    safetensors) args+=(-dict="$root/fuzz/safetensors.dict" -max_len=16384) ;;
    mask|options) args+=(-dict="$root/fuzz/options.dict" -max_len=512) ;;
  esac
  if [ "$mode" = runs ]; then
    # Deterministic: a fixed seed and run count; the time bound only guards a slow machine.
    args+=(-seed=1 -runs=30000 -max_total_time=60)
  else
    args+=(-max_total_time="$seconds")
  fi
  echo "fuzzers.sh: $t"
  dirs=("$build/corpus-$t" "$root/fuzz/corpus/$t")
  [ -d "$root/fuzz/regressions/$t" ] && dirs+=("$root/fuzz/regressions/$t")
  if ! "$build/fuzz/${t}_fuzz" "${args[@]}" "${extra[@]}" "${dirs[@]}" \
       > "$build/$t.log" 2>&1; then
    echo "fuzzers.sh: $t FAILED; the report (from $build/$t.log):" >&2
    grep -E "ERROR|SUMMARY|runtime error|_fuzz: |Test unit written|deadly signal|uncaught" "$build/$t.log" | head -20 >&2
    rc=1
  else
    grep -E "^stat::number_of_executed_units|^Done" "$build/$t.log" | tr '\n' ' '; echo
  fi
done
exit $rc
