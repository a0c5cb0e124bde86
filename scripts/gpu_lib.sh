# shellcheck shell=bash
# Sourced by the GPU scripts (gpu_first.sh, gpu_check.sh, gpu_bundle.sh): the one home of what
# they share -- is there a GPU, which python knows the CUDA wheels and where their libraries are,
# and steps that keep to a deadline. Plain bash, nothing compiled, nothing downloaded.

# One line naming the GPU (nvidia-smi -L's first, or the driver's /dev/nvidia0), or nothing.
gpu_found() {
  local line=""
  if command -v nvidia-smi > /dev/null 2>&1; then
    line=$(timeout 20 nvidia-smi -L 2> /dev/null | head -n 1)
  fi
  if [ -z "$line" ] && [ -r /proc/driver/nvidia/version ] && [ -e /dev/nvidia0 ]; then
    line="an NVIDIA GPU (/dev/nvidia0; driver: $(head -n 1 /proc/driver/nvidia/version))"
  fi
  printf '%s' "$line"
}

# Why gpu_found found nothing, in one phrase.
gpu_absent_reason() {
  local smi="nvidia-smi not found"
  command -v nvidia-smi > /dev/null 2>&1 && smi="nvidia-smi lists none"
  printf '%s, no /proc/driver/nvidia/version with /dev/nvidia0' "$smi"
}

# The python whose pip wheels carry cuDNN, NCCL, cudart, nvrtc: CTXPAR_PYTHON, else python3 on
# PATH (the GPU machine's venv), else the project's .venv.
gpu_python() {
  local py
  for py in "${CTXPAR_PYTHON:-}" python3 .venv/bin/python; do
    [ -n "$py" ] || continue
    if command -v "$py" > /dev/null 2>&1 && "$py" -c "import nvidia" > /dev/null 2>&1; then
      printf '%s' "$py"
      return 0
    fi
  done
  return 1
}

# The lib folders of that python's nvidia-* wheels (nvidia.__path__ entries, then */lib),
# ':'-joined; nothing when it has none. Where torch's wheels put them is not documented (cu13/lib
# for torch 2.15, <package>/lib for others): ask, do not guess.
gpu_wheel_libs() {
  "$1" - << 'EOF' 2> /dev/null
import glob, os
import nvidia
dirs = []
for root in list(nvidia.__path__):
    dirs += sorted(d for d in glob.glob(os.path.join(root, "*", "lib")) if os.path.isdir(d))
print(":".join(dirs))
EOF
}

# ---- steps under a deadline ------------------------------------------------------------------
# gpu_deadline SECONDS starts the clock; gpu_left says what is left. gpu_step NAME LIMIT CMD...
# runs CMD under `timeout` with min(LIMIT, left - 2) seconds, its output appended to $GPU_LOG,
# and sets GPU_RC, GPU_SECONDS and GPU_STATUS: passed | failed (exit N) | timed out after N s |
# not run (deadline) -- a step that did not run is never counted as passed. GPU_MIN_START: a
# step starts only with at least that many seconds left (default 5). GPU_STDOUT / GPU_STDERR:
# files for the command's stdout / stderr instead of $GPU_LOG.
GPU_LOG=${GPU_LOG:-/dev/null}
gpu_deadline() {
  GPU_DEADLINE=$((SECONDS + $1))
}
gpu_left() { echo $((GPU_DEADLINE - SECONDS)); }
gpu_step() {
  local name=$1 limit=$2 left
  shift 2
  left=$(gpu_left)
  GPU_RC="" GPU_SECONDS=0
  if [ "$left" -lt "${GPU_MIN_START:-5}" ]; then
    GPU_STATUS="not run (deadline)"
    echo "== $name: not run (deadline: ${left} s left)" >> "$GPU_LOG"
    return 0
  fi
  [ "$limit" -gt $((left - 2)) ] && limit=$((left - 2))
  echo "== $name (limit ${limit} s): $*" >> "$GPU_LOG"
  local t0=$SECONDS
  timeout --kill-after=3 "$limit" "$@" >> "${GPU_STDOUT:-$GPU_LOG}" 2>> "${GPU_STDERR:-$GPU_LOG}"
  GPU_RC=$?
  GPU_SECONDS=$((SECONDS - t0))
  case $GPU_RC in
    0) GPU_STATUS=passed ;;
    124 | 137) GPU_STATUS="timed out after ${limit} s" ;;
    *) GPU_STATUS="failed (exit $GPU_RC)" ;;
  esac
  echo "== $name: $GPU_STATUS after ${GPU_SECONDS} s" >> "$GPU_LOG"
}
