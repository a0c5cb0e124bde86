#!/usr/bin/env bash
# Fetches the header-only cudnn-frontend (Apache-2.0) from PyPI into third_party/cudnn_frontend
# (ignored by git; never committed): only its include/ folder is kept. Used by the device-less
# cuDNN graph check (tests/cuda/cudnn_graphs.cc; docs/cuda.md). Called by scripts/setup.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
version=1.32.0
dest=third_party/cudnn_frontend
if [ -f "$dest/include/cudnn_frontend.h" ] && [ "$(cat "$dest/VERSION" 2>/dev/null)" = "$version" ]; then
  exit 0
fi
python=${PYTHON:-python3}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
if ! "$python" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" \
    "nvidia-cudnn-frontend==$version"; then
  echo "scripts/cudnn_frontend.sh: pip could not download nvidia-cudnn-frontend==$version from PyPI" >&2
  echo "(needed by the cuDNN device-less check, ctest -L cuda); check the network or pip's index" >&2
  exit 1
fi
rm -rf "$dest"
mkdir -p "$dest"
"$python" - "$tmp" "$dest" <<'PY'
import glob, sys, zipfile
wheel = glob.glob(sys.argv[1] + "/*.whl")[0]
with zipfile.ZipFile(wheel) as z:
    z.extractall(sys.argv[2], [n for n in z.namelist() if n.startswith("include/")])
PY
echo "$version" > "$dest/VERSION"
echo "cudnn-frontend $version headers in $dest/include"
