#!/usr/bin/env bash
# The C++ and CUDA sources in the house style (.clang-format: Google's at 100 columns; clang-format
# 14, Debian 12's). `bash scripts/format.sh` formats every tracked file in place; `--check` only
# lists the files that are not formatted and fails (CTest entry `format`). A block that must keep
# its hand layout sits between `// clang-format off` and `// clang-format on`.
set -euo pipefail
cd "$(dirname "$0")/.."
check=0
case "${1:-}" in
  --check) check=1 ;;
  "") ;;
  *) echo "format.sh: unknown argument '$1' (--check, or nothing)" >&2; exit 2 ;;
esac
cf=$(command -v clang-format-14 || command -v clang-format || true)
[ -n "$cf" ] || { echo "format.sh: clang-format not found; install it (apt-get install clang-format, done by scripts/setup.sh)" >&2; exit 2; }
git rev-parse --git-dir >/dev/null 2>&1 ||
  { echo "format.sh: $(pwd) is not a git checkout; the files to format are the tracked ones" >&2; exit 2; }
mapfile -t files < <(git ls-files '*.cc' '*.h' '*.cu' '*.cuh' | grep -v '^third_party/')
if [ $check -eq 0 ]; then
  "$cf" -i "${files[@]}"
  exit 0
fi
bad=$("$cf" --dry-run "${files[@]}" 2>&1 | sed -n 's/^\([^:]*\):[0-9]*:[0-9]*: warning: code should be clang-formatted.*/\1/p' | sort -u)
if [ -n "$bad" ]; then
  echo "format.sh: not in the house style (run: bash scripts/format.sh):" >&2
  echo "$bad" >&2
  exit 1
fi
echo "format.sh: ${#files[@]} files in the house style"
