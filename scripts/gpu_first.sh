#!/usr/bin/env bash
# The first GPU window (docs/cuda.md, "The first GPU window"): run on the GPU machine
# from the bundle scripts/gpu_bundle.sh made on a CPU machine (.gpu/: bin, lib, manifest.txt);
# nothing is compiled or downloaded there.
#     bash scripts/gpu_first.sh          (the device tool: carry [".gpu"], timeout_s 600)
# It keeps to a hard deadline (CTXPAR_GPU_DEADLINE seconds, default 330: a case starts only
# with time left and gets at most that) and appends every result to $OUT the moment it exists
# (results.tsv, runs/), so a run killed at any point brings back what it had. A case that did
# not run is "not run", never passed. In priority order:
#   probe     the bundle against these sources, its libraries found, ctxpar --version (cuDNN,
#             NCCL: version and file), nvidia-smi, torch's view, a CPU run of the bundle's
#             ctxpar, the GPU's cuDNN device properties (device_properties.json)
#   fallback  ctxpar-cuda-check: the fallback kernel against the host tile math and fp64
#   cudnn     CTXPAR_CUDNN=require, one case per mask form, P = 2 loopback, bf16, --check
#   grid      every strategy x layout, P = 2 loopback, bf16 and fp32, --check
#   mid       T = 8192, P = 2 and 4, --check (rows sampled)
#   more      further cases while more time is left than sdpa and memcheck need
#   sdpa      torch's SDPA backends (bench/gpu_sdpa.py --torch-only) and ctxpar, 8K and 32K
#   memcheck  one short run under compute-sanitizer --tool memcheck
# and summary.txt last (also rewritten when the run is stopped). Without a GPU: the probe runs,
# every GPU case is listed "not run (no GPU)", exit 77.
# Settings: CTXPAR_GPU_BUNDLE (default .gpu), CTXPAR_GPU_DEADLINE (330), CTXPAR_PYTHON (the
# python whose nvidia-* wheels give cuDNN, NCCL, cudart, nvrtc; default python3), OUT (default
# out/gpu_first).
# Exit: 0 every case ran and passed; 1 a case failed, timed out or did not run; 2 no usable
# bundle or a bad setting; 77 no GPU.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
. scripts/gpu_lib.sh

bundle=${CTXPAR_GPU_BUNDLE:-.gpu}
budget=${CTXPAR_GPU_DEADLINE:-330}
out=${OUT:-out/gpu_first}
case $budget in
  '' | *[!0-9]*) echo "gpu_first: CTXPAR_GPU_DEADLINE='$budget': a whole number of seconds, e.g. 330" >&2; exit 2 ;;
esac
if [ ! -x "$bundle/bin/ctxpar" ] || [ ! -f "$bundle/manifest.txt" ]; then
  echo "gpu_first: no bundle at $bundle (bin/ctxpar, manifest.txt): make it on a CPU machine with" \
       "'bash scripts/gpu_bundle.sh' and carry $bundle beside the tree (docs/cuda.md)" >&2
  exit 2
fi
bundle=$(cd "$bundle" && pwd)
bin=$bundle/bin
gpu_deadline "$budget"
mkdir -p "$out/runs" || exit 2
out=$(cd "$out" && pwd)
log=$out/log.txt results=$out/results.tsv probe=$out/probe.txt
: > "$log"
printf 'stage\tcase\tstatus\tseconds\tdetail\n' > "$results"
cp "$bundle/manifest.txt" "$out/manifest.txt"
export OMP_NUM_THREADS=1 GPU_LOG=$log

say() { echo "gpu_first: $*" | tee -a "$log"; }
row() {  # one line of results.tsv: no tab or newline inside a field
  local f fields=()
  for f in "$@"; do fields+=("$(printf '%s' "$f" | tr '\t\n' '  ')"); done
  printf '%s\t%s\t%s\t%s\t%s\n' "${fields[@]}" >> "$results"
}

# ---- the libraries: the bundle's, the GPU machine's CUDA wheels (asked of its python) ----------
py=$(gpu_python) || py=""
wheels=""
[ -n "$py" ] && wheels=$(gpu_wheel_libs "$py")
# libstdc++ / libgcc_s travel in lib/compat and are used only where the system's are older than
# the build's (the manifest names the newest GLIBCXX symbol version the binaries need).
compat=""
need=$(sed -n 's/^needs libstdc++ //p' "$bundle/manifest.txt")
system=$(ldconfig -p 2> /dev/null | awk '/libstdc\+\+\.so\.6 .*x86-64/ {print $NF; exit}')
if [ -n "$need" ] && [ -d "$bundle/lib/compat" ] && { [ -z "$system" ] || ! grep -qa "$need" "$system"; }; then
  compat=$bundle/lib/compat
fi
export LD_LIBRARY_PATH="$bundle/lib${compat:+:$compat}${wheels:+:$wheels}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

# ---- cases -----------------------------------------------------------------------------------
gpu=$(gpu_found)
no_gpu=""
[ -z "$gpu" ] && no_gpu="no GPU: $(gpu_absent_reason)"

# What a case's files say, in one line: ctxpar --json's check and cuDNN use, or the last line of
# its output (stderr first when it failed).
detail() {
  local f=$1 status=$2
  if [ -n "$py" ] && [ -s "$f.out" ]; then
    "$py" - "$f.out" << 'EOF' 2> /dev/null && return 0
import json, sys
j = json.load(open(sys.argv[1]))
if not isinstance(j, dict) or "command" not in j:
    sys.exit(1)
parts = []
if "check_passed" in j:
    parts.append("check %s (max err %.3g, tolerance %.3g)" % (
        "passed" if j["check_passed"] else "FAILED", j.get("max_abs_err", 0), j.get("tolerance", 0)))
c = j.get("cudnn")
if c:
    parts.append("cuDNN %s: %d blocks (%d calls), %d on the fallback kernel, %d refused" % (
        c["version"] or "off (%s)" % c["off_reason"], c["blocks"], c["calls"],
        c["fallback_blocks"], c["refused_blocks"]))
parts.append("forward %.4g s" % j.get("forward_seconds", 0))
if j.get("backward"):
    parts.append("backward %.4g s" % j.get("backward_seconds", 0))
print("; ".join(parts))
EOF
  fi
  if grep -q '^CUDA: ' "$f.out" 2> /dev/null; then  # ctxpar --version: what it found
    grep '^CUDA: ' "$f.out" | sed 1d | tr '\n\t' '  ' | cut -c1-400
    return 0
  fi
  local from=$f.out
  [ "$status" != passed ] && [ -s "$f.err" ] && from=$f.err
  grep -v '^== ' "$from" 2> /dev/null | grep -v '^[[:space:]]*$' | tail -n 1 | tr '\t' ' ' | cut -c1-300
}

# Whether ctxpar's --json says every attention block ran as cuDNN calls (the cudnn stage: a
# smoke test of cuDNN that ran on the fallback kernel has not tested cuDNN).
all_on_cudnn() {
  [ -n "$py" ] && "$py" -c 'import json, sys
c = json.load(open(sys.argv[1]))["cudnn"]
sys.exit(0 if c["blocks"] > 0 and c["fallback_blocks"] == 0 else 1)' "$1" 2> /dev/null
}

# case_run STAGE NAME LIMIT CMD...: one case, now (stdout to runs/ID.out, stderr to runs/ID.err),
# then its row. A GPU case without a GPU is listed, not run.
case_run() {
  local stage=$1 name=$2 limit=$3
  shift 3
  if [ -n "$no_gpu" ] && [ "$stage" != probe ]; then
    row "$stage" "$name" "not run (no GPU)" 0 ""
    return 0
  fi
  local id
  id=$(printf '%s-%s' "$stage" "$name" | tr -c 'A-Za-z0-9.,+=-' '_')
  GPU_STDOUT=$out/runs/$id.out GPU_STDERR=$out/runs/$id.err GPU_LOG=$out/runs/$id.err \
    gpu_step "$stage $name" "$limit" "$@"
  if [ "$stage" = cudnn ] && [ "$GPU_STATUS" = passed ] && ! all_on_cudnn "$out/runs/$id.out"; then
    GPU_STATUS="failed (not every block on cuDNN)"
  fi
  row "$stage" "$name" "$GPU_STATUS" "$GPU_SECONDS" "$(detail "$out/runs/$id" "$GPU_STATUS")"
  echo "gpu_first: $stage $name: $GPU_STATUS (${GPU_SECONDS} s)" >> "$log"
}

# Up to $parallel cases at once (each appends its own row when it ends).
parallel=4
throttle() { while [ "$(jobs -rp | wc -l)" -ge "$parallel" ]; do wait -n; done; }

# ctxpar attention on the GPU, P ranks of one process (loopback), JSON out.
loop=("$bin/ctxpar" attention --device cuda --transport loopback --json)

summary() {
  local verdict
  {
    echo "ctxpar: the first GPU window -- $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
    echo "GPU: ${gpu:-$no_gpu}"
    echo "bundle: $(sed -n 's/^commit //p' "$bundle/manifest.txt" | head -n 1); $(sed -n 's/^built //p' "$bundle/manifest.txt" | head -n 1)"
    echo "deadline ${budget} s; used $((budget - $(gpu_left))) s"
    echo
    awk -F'\t' 'NR > 1 {
        s = $1; if (!(s in n)) order[++k] = s; n[s]++
        if ($3 == "passed") p[s]++; else if ($3 ~ /^not run/) nr[s]++; else if ($3 ~ /^timed out/) t[s]++; else f[s]++ }
      END {
        printf "%-9s %6s %7s %7s %10s %8s\n", "stage", "cases", "passed", "failed", "timed out", "not run"
        for (i = 1; i <= k; i++) { s = order[i]
          printf "%-9s %6d %7d %7d %10d %8d\n", s, n[s], p[s], f[s], t[s], nr[s]
          N += n[s]; P += p[s]; F += f[s]; T += t[s]; R += nr[s] }
        printf "%-9s %6d %7d %7d %10d %8d\n", "total", N, P, F, T, R
      }' "$results"
    echo
    if [ -n "$no_gpu" ]; then
      verdict="NO GPU: the probe ran; every GPU case is listed as not run ($no_gpu)"
    else
      verdict=$(awk -F'\t' 'NR > 1 { n++; if ($3 == "passed") p++; else if ($3 ~ /^not run/) r++; else f++ }
        END { if (f) printf "FAILED: %d case(s) failed or timed out", f
              else if (r) printf "INCOMPLETE: %d case(s) not run", r
              else printf "PASSED: all %d cases ran and passed", n }' "$results")
    fi
    echo "verdict: $verdict"
    awk -F'\t' 'NR > 1 && $3 != "passed" && $3 !~ /^not run \(no GPU\)/ {
        if (!h++) print "\nnot passed:"; printf "  %s %s: %s -- %s\n", $1, $2, $3, $5 }' "$results"
    [ -n "$py" ] && "$py" bench/gpu_sdpa.py --table "$out/runs" 2> /dev/null
  } > "$out/summary.txt"
  cat "$out/summary.txt"
}
trap 'say "stopped (signal) after $((budget - $(gpu_left))) s"; summary > /dev/null; exit 1' TERM INT

# ---- 1. probe --------------------------------------------------------------------------------
say "GPU: ${gpu:-$no_gpu}; deadline ${budget} s; bundle $bundle; python ${py:-none}; results in $out"
{
  echo "GPU: ${gpu:-$no_gpu}"
  echo "python: ${py:-none (no python with nvidia-* wheels: cuDNN / NCCL / nvrtc not found)}"
  echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
  echo "libstdc++: system ${system:-none found}; the binaries need ${need:-?}; compat ${compat:-not used}"
} > "$probe"

# The bundle against these sources: the manifest lists the sha256 of every source file it was
# built from. Another commit's bundle runs all the same (the window is scarce), flagged here and
# at the top of the summary.
t0=$SECONDS
sed -n 's/^source \([0-9a-f]*\) \(.*\)$/\1  \2/p' "$bundle/manifest.txt" > "$out/sources.sha256"
total=$(wc -l < "$out/sources.sha256")
differ=$(sha256sum -c --quiet "$out/sources.sha256" 2> /dev/null | grep -c ': FAILED' || true)
if [ "$total" -gt 0 ] && [ "$differ" -eq 0 ]; then
  row probe bundle passed $((SECONDS - t0)) "built from these sources ($total files)"
else
  files=$(sha256sum -c --quiet "$out/sources.sha256" 2> /dev/null | grep ': FAILED' | cut -d: -f1 | head -n 5 | tr '\n' ' ')
  row probe bundle "failed (stale bundle)" $((SECONDS - t0)) "$differ of $total source files differ from the bundle's: $files"
  say "WARNING: STALE BUNDLE: $differ of $total source files differ from those $bundle was built from ($files...); its results speak for $(sed -n 's/^commit //p' "$bundle/manifest.txt")"
fi

# Every library each binary needs, found (the bundle's lib, the wheels, the system).
t0=$SECONDS
missing=""
for b in "$bin"/*; do
  echo "ldd $(basename "$b"):" >> "$probe"
  if ! ldd "$b" > "$out/ldd.txt" 2>&1; then  # a library that is there but does not load
    missing="$missing$(basename "$b"): $(head -n 1 "$out/ldd.txt") "
  else
    m=$(awk '/not found/ {print $1}' "$out/ldd.txt" | tr '\n' ' ')
    [ -n "$m" ] && missing="$missing$(basename "$b"): $m"
  fi
  cat "$out/ldd.txt" >> "$probe"
done
rm -f "$out/ldd.txt"
if [ -z "$missing" ]; then
  row probe libraries passed $((SECONDS - t0)) "every library of $(cd "$bin" && echo *) found"
else
  row probe libraries failed $((SECONDS - t0)) "not found: $missing"
fi

case_run probe version 20 "$bin/ctxpar" --version
cat "$out/runs/probe-version.out" >> "$probe" 2> /dev/null
if command -v nvidia-smi > /dev/null 2>&1; then
  case_run probe nvidia-smi 20 nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
else
  row probe nvidia-smi "not run (nvidia-smi not found)" 0 ""
fi
if [ -n "$py" ]; then
  case_run probe torch 60 "$py" -c 'import json, torch
v = {"torch": torch.__version__, "cuda": torch.version.cuda, "available": torch.cuda.is_available()}
for key, f in (("cudnn", torch.backends.cudnn.version), ("nccl", lambda: torch.cuda.nccl.version()),
               ("device", lambda: torch.cuda.get_device_name(0))):
    try:
        v[key] = f()
    except Exception as e:
        v[key] = "%s: %s" % (type(e).__name__, str(e)[:200])
print(json.dumps(v, default=str))'
else
  row probe torch "failed (no python)" 0 "no python3 with the nvidia-* wheels (CTXPAR_PYTHON)"
fi
case_run probe cpu-run 60 "$bin/ctxpar" attention --device cpu --seq 256 --heads 4 --kv-heads 2 \
  --head-dim 32 --ranks 2 --mask causal --backward --check --json
if [ -z "$no_gpu" ] && [ -x "$bin/cuda_cudnn_graphs" ]; then
  case_run probe device-properties 40 "$bin/cuda_cudnn_graphs" --save-properties "$out/device_properties.json"
fi

# ---- 2. the fallback kernel ------------------------------------------------------------------
case_run fallback ctxpar-cuda-check 90 "$bin/ctxpar-cuda-check"

# ---- 3. cuDNN, one case per mask form (CTXPAR_CUDNN=require: a refusal is a failure) ---------
small=(--seq 512 --heads 8 --kv-heads 2 --head-dim 64 --ranks 2 --dtype bf16 --backward --check)
for form in "none contiguous" "causal contiguous" "causal zigzag" "causal striped" \
            "window:64,16 contiguous" "causal+window:96,0 zigzag" "causal+documents:200,312 contiguous"; do
  read -r mask layout <<< "$form"
  case_run cudnn "$mask $layout" 60 env CTXPAR_CUDNN=require "${loop[@]}" "${small[@]}" \
    --mask "$mask" --layout "$layout"
done

# ---- 4. every strategy x layout, P = 2, bf16 and fp32 ----------------------------------------
for dtype in bf16 fp32; do
  for strategy in ring allgather ulysses hybrid; do
    for layout in contiguous zigzag striped; do
      throttle
      case_run grid "$strategy $layout $dtype" 60 "${loop[@]}" --seq 512 --heads 8 --kv-heads 2 \
        --head-dim 64 --ranks 2 --dtype "$dtype" --strategy "$strategy" --layout "$layout" \
        --mask causal --backward --check &
    done
  done
done
wait

# ---- 5. mid-size, one at a time ---------------------------------------------------------------
for c in "ring 2 bf16" "ring 4 bf16" "ring 4 fp32" "ulysses 4 bf16"; do
  read -r strategy ranks dtype <<< "$c"
  case_run mid "T=8192 $strategy P=$ranks $dtype" 90 "${loop[@]}" --seq 8192 --heads 8 \
    --kv-heads 2 --head-dim 64 --ranks "$ranks" --dtype "$dtype" --strategy "$strategy" \
    --layout zigzag --mask causal --backward --check
done

# ---- 6. more, while time is left beyond what sdpa and memcheck need ---------------------------
reserve=150
for mask in none causal+window:256,0 causal+documents:700,1348; do
  for strategy in ring allgather ulysses hybrid; do
    name="T=2048 P=4 $strategy $mask"
    if [ -z "$no_gpu" ] && [ "$(gpu_left)" -le "$reserve" ]; then
      row more "$name" "not run (deadline)" 0 "kept ${reserve} s for sdpa and memcheck"
      continue
    fi
    throttle
    case_run more "$name" 60 "${loop[@]}" --seq 2048 --heads 8 --kv-heads 2 --head-dim 64 \
      --ranks 4 --dtype bf16 --strategy "$strategy" --layout zigzag --mask "$mask" --backward \
      --check &
  done
done
wait

# ---- 7. ctxpar against torch's SDPA backends -------------------------------------------------
big=(--heads 32 --kv-heads 8 --head-dim 128 --dtype bf16 --mask causal --ranks 1 --repeats 3)
for t in 8192 32768; do
  if [ -n "$py" ]; then
    case_run sdpa "torch T=$t" 90 "$py" bench/gpu_sdpa.py --torch-only --seqs "$t" \
      "$out/runs/sdpa-torch-$t.json" 80
  else
    row sdpa "torch T=$t" "failed (no python)" 0 ""
  fi
  case_run sdpa "ctxpar T=$t fwd" 60 "$bin/ctxpar" attention --device cuda --json --seq "$t" \
    "${big[@]}"
  case_run sdpa "ctxpar T=$t fwd+bwd" 90 "$bin/ctxpar" attention --device cuda --json --seq "$t" \
    "${big[@]}" --backward
done

# ---- 8. one short memcheck run ---------------------------------------------------------------
sanitizer=$(command -v compute-sanitizer)
for s in /usr/local/cuda/bin/compute-sanitizer /usr/local/cuda/compute-sanitizer/compute-sanitizer; do
  [ -z "$sanitizer" ] && [ -x "$s" ] && sanitizer=$s
done
if [ -n "$sanitizer" ] || [ -n "$no_gpu" ]; then
  case_run memcheck "fallback fp32 P=2" 120 env CTXPAR_CUDNN=off "${sanitizer:-compute-sanitizer}" \
    --tool memcheck --error-exitcode 9 "${loop[@]}" --seq 256 --heads 4 --kv-heads 2 \
    --head-dim 32 --ranks 2 --mask causal --backward --check
else
  row memcheck "fallback fp32 P=2" "not run (compute-sanitizer not found)" 0 ""
fi

summary
[ -n "$no_gpu" ] && exit 77
awk -F'\t' 'NR > 1 && $3 != "passed" { bad = 1 } END { exit bad }' "$results"
