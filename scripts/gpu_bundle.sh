#!/usr/bin/env bash
# The bundle of the GPU window (docs/cuda.md, "The first GPU window"), made on a CPU
# machine: the GPU-facing binaries, built with CUDA, and every shared library they need that the
# GPU machine may lack, in .gpu/ (git-ignored, at most 64 MiB): what the device tool carries
# beside the tree for scripts/gpu_first.sh, which compiles nothing.
#   bash scripts/gpu_bundle.sh                       configure and build build-gpu-bundle, pack
#   bash scripts/gpu_bundle.sh --from DIR [--out D]  pack the binaries of a CUDA build already
#                                                    made (no compile: the CI dry run)
# Layout: bin/ (ctxpar, ctxpar-cuda-check, cuda_cudnn_graphs where the cuDNN frontend was
# found), lib/ (what ldd lists beyond the system's: OpenBLAS, gfortran, quadmath, Highway,
# OpenMP, Gloo ...), lib/compat/ (libstdc++, libgcc_s: used by gpu_first.sh only where the GPU
# machine's are older than the build's), manifest.txt (the commit, the build, each file's size
# and sha256, and the sha256 of every source file, which gpu_first.sh checks against its tree).
# Not packed: glibc and libz (every machine that runs the GPU machine's python has them), the
# driver's libcuda, and the CUDA libraries of the GPU machine's torch wheels (cudart, nvrtc,
# cuDNN, NCCL, cuBLAS), which gpu_first.sh finds by asking that python.
# The build differs from ./build (scripts/build.sh) in: no MPI (its run-time plugins cannot be
# carried; the window uses the loopback transport), no dev/ lab, only the bundle's targets,
# RPATH $ORIGIN/../lib and nothing else (DT_RPATH, so that the packed libraries' own
# dependencies resolve there too; a build-tree RPATH would name this machine's CUDA folders,
# searched before LD_LIBRARY_PATH, as the dry run found), stripped. Same -march (x86-64-v2, CTXPAR_ARCH): the GPU machine's CPU is not known.
# Exit: 0 packed; 1 a build or pack failure, or over 64 MiB; 2 bad usage.
set -euo pipefail
cd "$(dirname "$0")/.."
from="" dest=.gpu
while [ $# -gt 0 ]; do
  case $1 in
    --from) from=${2:?--from needs a build folder}; shift 2 ;;
    --out) dest=${2:?--out needs a folder}; shift 2 ;;
    *) echo "gpu_bundle: unknown argument '$1'; usage: scripts/gpu_bundle.sh [--from BUILD_DIR] [--out DIR]" >&2; exit 2 ;;
  esac
done
limit=$((64 * 1024 * 1024))
if ! git rev-parse HEAD > /dev/null 2>&1; then
  echo "gpu_bundle: run it in a git checkout of ctxpar (the manifest names the commit)" >&2
  exit 2
fi

frontend=third_party/cudnn_frontend/include/cudnn_frontend.h
if [ -z "$from" ]; then
  [ -f "$frontend" ] || { echo "gpu_bundle: $frontend missing: run scripts/cudnn_frontend.sh (PyPI) first; without it the bundle's ctxpar has no cuDNN path to try on the GPU" >&2; exit 1; }
  build="build-gpu-bundle"
  export CCACHE_BASEDIR="$PWD" CCACHE_NOHASHDIR=1
  launcher=()
  command -v ccache > /dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
  # shellcheck disable=SC2016  # $ORIGIN is the loader's, not the shell's
  cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DCTXPAR_CUDA=ON -DCTXPAR_MPI=OFF \
    -DCTXPAR_DEV=OFF -DCTXPAR_TESTS=ON -DCMAKE_BUILD_WITH_INSTALL_RPATH=ON \
    '-DCMAKE_INSTALL_RPATH=$ORIGIN/../lib' -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=OFF \
    -DCMAKE_EXE_LINKER_FLAGS=-Wl,--disable-new-dtags "${launcher[@]}" > /dev/null
  targets=(ctxpar_cli ctxpar_cuda_check)
  ninja -C "$build" -t targets all | grep -q '^cuda_cudnn_graphs:' && targets+=(cuda_cudnn_graphs)
  cmake --build "$build" -j "$(nproc)" --target "${targets[@]}"
  how="built by scripts/gpu_bundle.sh in $build: Release, CTXPAR_CUDA=ON, CTXPAR_MPI=OFF, RPATH \$ORIGIN/../lib, stripped"
else
  build=$from
  if [ ! -x "$build/ctxpar" ] || [ ! -x "$build/ctxpar-cuda-check" ]; then
    echo "gpu_bundle: --from $build: no ctxpar and ctxpar-cuda-check there (a build with CUDA, e.g. ./build where nvcc was found)" >&2
    exit 2
  fi
  how="packed by scripts/gpu_bundle.sh --from $build (that build's flags; no RPATH: gpu_first.sh's LD_LIBRARY_PATH)"
fi
binaries=("$build/ctxpar" "$build/ctxpar-cuda-check")
[ -x "$build/tests/cuda/cuda_cudnn_graphs" ] && binaries+=("$build/tests/cuda/cuda_cudnn_graphs")

rm -rf "$dest"
mkdir -p "$dest/bin" "$dest/lib/compat"
cp "${binaries[@]}" "$dest/bin/"
[ -z "$from" ] && strip --strip-unneeded "$dest"/bin/*

# What ldd resolves, sorted into: the system's (not packed), the GPU machine's CUDA (not
# packed), libstdc++ / libgcc_s (compat), the rest (lib/). Anything not found stops here.
manifest=$dest/manifest.txt
libs=$(mktemp)
trap 'rm -f "$libs"' EXIT
for b in "$dest"/bin/*; do
  ldd "$b" | awk -v bin="$(basename "$b")" '
    $2 == "=>" && $3 == "not" { print "missing " $1 " " bin; next }
    $2 == "=>" { print "found " $1 " " $3 }' >> "$libs"
done
if grep -q '^missing' "$libs"; then
  echo "gpu_bundle: libraries not found here: $(grep '^missing' "$libs" | cut -d' ' -f2- | tr '\n' ';')" >&2
  exit 1
fi
packed=() skipped=()
while read -r _ name path; do
  case $name in
    libc.so.* | libm.so.* | libdl.so.* | libpthread.so.* | librt.so.* | libresolv.so.* | \
      libutil.so.* | libz.so.* | ld-linux*) skipped+=("$name (system)") ;;
    libcuda.so.* | libcudart.so.* | libnvrtc* | libcudnn* | libnccl* | libcublas* | libnvJitLink*)
      skipped+=("$name (the GPU machine's driver / CUDA wheels)") ;;
    libstdc++.so.* | libgcc_s.so.*) cp -L "$path" "$dest/lib/compat/$name"; packed+=("compat/$name $path") ;;
    *) cp -L "$path" "$dest/lib/$name"; packed+=("$name $path") ;;
  esac
done < <(sort -u "$libs")

# The newest symbol versions the binaries and packed libraries need (gpu_first.sh: libstdc++).
newest() { strings -a "$dest"/bin/* "$dest"/lib/*.so* 2> /dev/null | grep -o "^$1_[0-9.]*[0-9]$" | sort -uV | tail -n 1; }
commit=$(git rev-parse HEAD)
sources=(CMakeLists.txt cmake src include tools tests/cuda/CMakeLists.txt tests/cuda/cudnn_graphs.cc)
dirty=$(git status --porcelain --untracked-files=no -- "${sources[@]}" | wc -l)
{
  echo "ctxpar GPU bundle (scripts/gpu_bundle.sh; docs/cuda.md, \"The first GPU window\")"
  echo "commit $commit$([ "$dirty" -gt 0 ] && echo " + $dirty changed source file(s)")"
  echo "built $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(uname -n): $how"
  LD_LIBRARY_PATH="$dest/lib:$dest/lib/compat" "$dest/bin/ctxpar" --version | sed 's/^/version /'
  echo "cudnn-frontend $(cat third_party/cudnn_frontend/VERSION 2> /dev/null || echo 'not found: no cuDNN path')"
  echo "needs glibc $(newest GLIBC)"
  echo "needs libstdc++ $(newest GLIBCXX)"
  for f in "$dest"/bin/* "$dest"/lib/*.so* "$dest"/lib/compat/*; do
    [ -f "$f" ] || continue
    echo "file ${f#"$dest"/} $(stat -c %s "$f") $(sha256sum "$f" | cut -d' ' -f1)"
  done
  for p in "${packed[@]}"; do echo "packed $p"; done
  for s in "${skipped[@]}"; do echo "not packed $s"; done
  git ls-files -- "${sources[@]}" | while read -r f; do
    echo "source $(sha256sum "$f" | cut -d' ' -f1) $f"
  done
} > "$manifest"

bytes=$(find "$dest" -type f -printf '%s\n' | awk '{s += $1} END {print s + 0}')
mib=$(awk -v b="$bytes" 'BEGIN {printf "%.1f", b / 1048576}')
if [ -z "$from" ]; then
  # The RPATH finds the packed libraries without LD_LIBRARY_PATH.
  for b in "$dest"/bin/*; do
    # shellcheck disable=SC2016  # the literal $ORIGIN
    readelf -d "$b" | grep -q 'RPATH.*\[\$ORIGIN/../lib\]' ||
      { echo "gpu_bundle: $b: RPATH is not \$ORIGIN/../lib alone: $(readelf -d "$b" | grep PATH)" >&2; exit 1; }
  done
  lib=$(cd "$dest/lib" && pwd)
  wrong=$(env -u LD_LIBRARY_PATH ldd "$dest/bin/ctxpar" | awk '$2 == "=>" { print $1, $3 }' |
    while read -r name path; do
      if [ -f "$lib/$name" ] && [ "$(realpath "$path")" != "$lib/$name" ]; then
        echo "$name -> $path"
      fi
    done)
  [ -z "$wrong" ] || { echo "gpu_bundle: not taken from $dest/lib: $wrong" >&2; exit 1; }
  if [ "$bytes" -gt "$limit" ]; then
    echo "gpu_bundle: $dest is $mib MiB, over the 64 MiB the device tool carries; largest:" >&2
    find "$dest" -type f -printf '%s %p\n' | sort -rn | head -n 5 >&2
    exit 1
  fi
fi
echo "gpu_bundle: $dest: $mib MiB ($(find "$dest" -type f | wc -l) files), commit ${commit:0:12}$([ "$dirty" -gt 0 ] && echo " + $dirty changed"); run there: bash scripts/gpu_first.sh (carry [\"$dest\"])"
