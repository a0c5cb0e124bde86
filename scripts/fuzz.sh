#!/usr/bin/env bash
# Builds the libFuzzer target for the .npy reader (fuzz/npy_fuzz.cc) with clang, AddressSanitizer
# and UndefinedBehaviorSanitizer, and runs it for a bounded time. The build is separate from the
# CMake one (the project builds with GCC; libFuzzer needs clang), and compiles only what the
# parser uses: src/io/npy.cc, npy_header.cc, npy_write.cc and output_file.cc (round trips) and
# src/core/*.cc.
#
#   scripts/fuzz.sh                       # build if stale, fuzz 25 s (what the test suite does)
#   scripts/fuzz.sh --seconds 3600        # a longer run; see docs/cli-files.md
#   scripts/fuzz.sh --build-only
#   scripts/fuzz.sh --seconds 600 -- -jobs=2 -workers=2   # extra libFuzzer flags after --
#
# New interesting inputs go to BUILD/corpus-npy (the committed seeds in fuzz/corpus/npy stay
# as they are); a crash leaves BUILD/crash-* and makes this script exit non-zero. Reproduce
# one with: BUILD/npy_fuzz BUILD/crash-<hash>
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
build="$root/build-fuzz"
seconds=25
build_only=0
extra=()
while [ $# -gt 0 ]; do
  case "$1" in
    --seconds) seconds="$2"; shift 2 ;;
    --build-dir) build="$2"; shift 2 ;;
    --build-only) build_only=1; shift ;;
    --) shift; extra=("$@"); break ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "fuzz.sh: unknown argument '$1' (--seconds N, --build-dir DIR, --build-only, -- FLAGS)" >&2; exit 2 ;;
  esac
done
cxx="$(command -v clang++-14 || command -v clang++ || true)"
if [ -z "$cxx" ]; then
  echo "fuzz.sh: clang++ not found; install clang and libclang-rt-14-dev (scripts/setup.sh)" >&2
  exit 2
fi
mkdir -p "$build" "$build/corpus-npy"
bin="$build/npy_fuzz"
srcs=("$root/fuzz/npy_fuzz.cc" "$root/src/io/npy.cc" "$root/src/io/npy_header.cc" "$root/src/io/npy_write.cc" "$root/src/io/output_file.cc" "$root"/src/core/*.cc)
stale=0
[ -x "$bin" ] || stale=1
for f in "${srcs[@]}" "$root"/include/ctxpar/*.h "$root"/src/io/*.h "$0"; do
  [ "$f" -nt "$bin" ] && stale=1
done
if [ $stale -eq 1 ]; then
  echo "fuzz.sh: building $bin"
  # -O1 -g: sanitizer reports with line numbers; no -march=native so a crash file replays
  # on any machine.
  "$cxx" -std=c++20 -O1 -g -fno-omit-frame-pointer \
    -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
    -I"$root/include" -I"$root/src" "${srcs[@]}" -o "$bin.tmp"
  mv "$bin.tmp" "$bin"
fi
[ $build_only -eq 1 ] && exit 0
cd "$build"
# -rss_limit_mb: a parser that allocated what a lying header asks for would trip it.
exec "$bin" -max_total_time="$seconds" -max_len=4096 -rss_limit_mb=1024 -timeout=10 \
  -dict="$root/fuzz/npy.dict" -artifact_prefix="$build/" -print_final_stats=1 \
  "${extra[@]}" "$build/corpus-npy" "$root/fuzz/corpus/npy"
