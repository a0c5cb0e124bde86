#!/usr/bin/env bash
# torchrun.sh <torchrun> <nproc> <program> [args]: runs the program under a real torchrun
# (--standalone: a free port for the agent's store). CTXPAR_TORCHRUN overrides <torchrun>.
# torchrun.sh <torchrun> --python <script> [args]: the python beside that torchrun (its venv).
# Fails, saying how to get it, when torchrun is missing (CI must not skip these tests).
root=$(cd "$(dirname "$0")/../.." && pwd)
t=${CTXPAR_TORCHRUN:-$1}
# Configured before scripts/setup.sh made the venv: look where it puts torchrun.
for c in "$root/.venv-torch/bin/torchrun" "$root/.venv/bin/torchrun"; do
  [ -n "$t" ] || { [ -x "$c" ] && t=$c; }
done
shift
if [ -z "$t" ] || [ ! -x "$t" ]; then
  echo "FAIL: torchrun not found ('$t'): run scripts/setup.sh (it makes .venv-torch), or" \
       "configure with -DCTXPAR_TORCHRUN=/path/to/torchrun, or set CTXPAR_TORCHRUN" >&2
  exit 1
fi
if [ "$1" = --python ]; then
  shift
  exec timeout 170 "$(dirname "$t")/python" "$@"
fi
n=$1
shift
# torchrun's agent leaves its torchelastic_* folders in TMPDIR: a folder of this run's own,
# removed after it.
tmp=$(mktemp -d "${TMPDIR:-/tmp}/ctxpar_torchrun.XXXXXX")
TMPDIR=$tmp timeout 170 "$t" --no-python --standalone --nproc-per-node "$n" "$@"
rc=$?
rm -rf "$tmp"
exit $rc
