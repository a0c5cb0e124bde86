#!/usr/bin/env bash
# CTest gpu_first_dry: scripts/gpu_first.sh from a freshly packed bundle, in an
# environment that looks like the GPU machine without its GPU -- a private mount namespace where
# every system library the bundle packed and every cuDNN / NCCL outside the python venv is an
# empty file (as tests/python/test_no_mpi.py hides libmpi), no network (unshare -n), and only
# the venv's nvidia-* wheels for cuDNN, NCCL, cudart, nvrtc. It must find every library, say
# "no GPU" in its summary, write its files, and take under 60 s. The bundle packs ./build's
# binaries (scripts/gpu_bundle.sh --from: nothing is compiled).
# usage: gpu_first_dry.sh BUILD_DIR [BUNDLE]   (CTXPAR_PYTHON: the venv's python; default .venv)
#   BUNDLE: run that bundle instead (e.g. .gpu from scripts/gpu_bundle.sh, before a window).
# Exit: 0 passed, 1 failed (saying what), 77 skipped: unshare -m -n is not allowed here.
set -uo pipefail
src=$(cd "$(dirname "$0")/../.." && pwd)
build=$(cd "${1:?usage: gpu_first_dry.sh BUILD_DIR}" && pwd)
py=${CTXPAR_PYTHON:-$src/.venv/bin/python}
start=$SECONDS
fail() {
  echo "gpu_first_dry: FAILED: $*" >&2
  exit 1
}
"$py" -c "import nvidia" 2> /dev/null ||
  fail "no python with the nvidia-* wheels at $py (scripts/setup.sh makes .venv with torch; or set CTXPAR_PYTHON)"
if ! unshare -m -n true 2> /dev/null; then
  echo "gpu_first_dry: skipped: unshare -m -n is not allowed here (not root?): the system libraries cannot be hidden"
  exit 77
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if [ -n "${2:-}" ]; then
  cp -r "$2" "$tmp/.gpu" || fail "no bundle at $2"
else
  bash "$src/scripts/gpu_bundle.sh" --from "$build" --out "$tmp/.gpu" > "$tmp/bundle.log" 2>&1 ||
    fail "scripts/gpu_bundle.sh --from $build: $(tail -n 3 "$tmp/bundle.log")"
fi

# What the GPU machine lacks (../shared/GPU-NOTES.md, "The GPU machine"), decided here and not
# by the bundle script: every library ./build's binaries load but the C runtime (glibc, libz,
# libstdc++, libgcc_s) and the CUDA toolkit's runtime (cudart, nvrtc: nvcc 13 is there), and
# any cuDNN or NCCL that is not the venv's (the toolkit's here: there they are wheels only).
venv_nvidia=$("$py" -c "import nvidia, os; print(os.path.realpath(list(nvidia.__path__)[0]))")
hide=$( {
  for b in "$build/ctxpar" "$build/ctxpar-cuda-check"; do
    ldd "$b" | awk '$2 == "=>" && $3 ~ /^\// &&
      $1 !~ /^(libc|libm|libdl|libpthread|librt|libresolv|libutil|libz|libstdc\+\+|libgcc_s|libcudart|libnvrtc)\./ {print $3}'
  done
  ldconfig -p | awk '/lib(cudnn|nccl)/ {print $NF}'
  ls /usr/local/cuda*/lib*/libcudnn* /usr/local/cuda*/lib*/libnccl* 2> /dev/null
} | xargs -r realpath | sort -u | grep -v "^$venv_nvidia/")
[ -n "$hide" ] || fail "nothing to hide: ./build's binaries load no library beyond the C runtime"
: > "$tmp/empty.so"
mkdir -p "$tmp/out"

# Inside: first show that the hiding holds (./build's own ctxpar cannot start without the
# bundle) and that there is no network, then run the window.
# shellcheck disable=SC2016  # expanded by the inner sh
inside='for f in "$@"; do case $f in --) shift; break;; esac; mount --bind "$0" "$f" || exit 97; shift; done
if env -u LD_LIBRARY_PATH "$BUILD/ctxpar" --version > /dev/null 2>&1; then echo "hiding failed: $BUILD/ctxpar still starts"; exit 98; fi
if awk "NR > 2" /proc/net/dev | grep -vq "^ *lo:"; then echo "a network interface is visible"; exit 99; fi
exec "$@"'
# shellcheck disable=SC2086  # $hide: one path per word
BUILD=$build unshare -m -n sh -c "$inside" "$tmp/empty.so" $hide -- \
  env OUT="$tmp/out" CTXPAR_PYTHON="$py" CTXPAR_GPU_BUNDLE="$tmp/.gpu" \
  bash "$src/scripts/gpu_first.sh" > "$tmp/run.log" 2>&1
rc=$?
seconds=$((SECONDS - start))
seconds_hidden=$seconds
out=$tmp/out
[ "$rc" -eq 77 ] || fail "gpu_first.sh exited $rc, not 77 (no GPU): $(tail -n 20 "$tmp/run.log")"
for f in summary.txt results.tsv log.txt probe.txt manifest.txt; do
  [ -s "$out/$f" ] || fail "\$OUT/$f missing or empty"
done
grep -q "^verdict: NO GPU" "$out/summary.txt" || fail "the summary does not say no GPU: $(cat "$out/summary.txt")"
for c in bundle libraries version torch cpu-run; do
  grep -q "^probe	$c	passed	" "$out/results.tsv" ||
    fail "probe $c did not pass: $(grep "^probe	$c	" "$out/results.tsv")"
done
# cuDNN and NCCL from the venv's wheels, and that cuDNN usable (the version floor).
grep -q "cuDNN headers .*found here: 9\.[0-9]*\.[0-9]*, usable ($venv_nvidia/" "$out/runs/probe-version.out" ||
  fail "cuDNN not found usable in the venv's wheels: $(cat "$out/runs/probe-version.out")"
grep -q "NCCL headers .*found here: .*($venv_nvidia/" "$out/runs/probe-version.out" ||
  fail "NCCL not found in the venv's wheels: $(cat "$out/runs/probe-version.out")"
# Every GPU case listed, none run, none passed.
gpu_rows=$(awk -F'\t' 'NR > 1 && $1 != "probe"' "$out/results.tsv" | wc -l)
not_run=$(awk -F'\t' 'NR > 1 && $1 != "probe" && $3 == "not run (no GPU)"' "$out/results.tsv" | wc -l)
if [ "$gpu_rows" -eq 0 ] || [ "$gpu_rows" -ne "$not_run" ]; then
  fail "$gpu_rows GPU cases, $not_run of them 'not run (no GPU)'"
fi
[ "$seconds" -lt 60 ] || fail "took $seconds s (the limit is 60 s)"

# A bundle built from other sources runs, flagged; no bundle, or a bad deadline: exit 2 at once.
sed -i '0,/^source [0-9a-f]* /s//source 0000000000000000000000000000000000000000000000000000000000000000 /' \
  "$tmp/.gpu/manifest.txt"
OUT="$tmp/stale" CTXPAR_PYTHON="$py" CTXPAR_GPU_BUNDLE="$tmp/.gpu" bash "$src/scripts/gpu_first.sh" \
  > "$tmp/stale.log" 2>&1
grep -q "^probe	bundle	failed (stale bundle)	.*1 of [0-9]* source files differ" "$tmp/stale/results.tsv" ||
  fail "a stale bundle was not flagged: $(grep "^probe	bundle" "$tmp/stale/results.tsv")"
grep -q "WARNING: STALE BUNDLE" "$tmp/stale.log" || fail "no warning for a stale bundle"
for bad in "CTXPAR_GPU_BUNDLE=$tmp/none" "CTXPAR_GPU_DEADLINE=5min"; do
  env "$bad" OUT="$tmp/bad" bash "$src/scripts/gpu_first.sh" > "$tmp/bad.log" 2>&1
  rc=$?
  if [ "$rc" -ne 2 ] || ! grep -q "^gpu_first: CTXPAR_GPU_\|^gpu_first: no bundle at" "$tmp/bad.log"; then
    fail "$bad: exit $rc, not 2 with the reason: $(cat "$tmp/bad.log")"
  fi
done
seconds=$((SECONDS - start))
echo "gpu_first_dry: passed in $seconds s (the hidden run $((seconds_hidden)) s): $(wc -w <<< "$hide") system libraries hidden, no network; $gpu_rows GPU cases listed as not run"
