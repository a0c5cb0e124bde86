#!/usr/bin/env bash
# The CPU measurement suite in one run: ctxpar's kernel against this machine's FMA peak,
# ctxpar against PyTorch's CPU scaled_dot_product_attention (a pinned current torch from PyPI,
# in its own venv), the ring P=2 against one rank with two threads, zigzag against contiguous.
# decode_1t: one decoded token over a 128K fp32 cache against the read bandwidth of the same
# thread (`ctxpar bench decode`, both measured in the same run).
# Every figure is a ratio of runs taken in the same repetition; the repetitions alternate the
# order of the runs (forward, then reversed) so that a slow drift of the machine falls on both
# sides; the table gives the median and the spread over repetitions. Under it, for fp32, what
# 1.2 x torch needs of this CPU's FMA peak (1.2 x torch's share) beside ctxpar's share: where the
# need is above what FMA products reach here, the goal is out of reach of FMAs on this CPU kind.
# Each torch run is bracketed by the FMA peak (`ctxpar bench kernel --peak-only`), as each
# ctxpar run measures its own, and every ctxpar / torch ratio is given again with each side
# divided by its peak: the host's clock moves the peak itself, and that cancels.
# Run it on a quiet machine:
#
#   bash bench/cpu_suite.sh --out bench-cpu-suite            # ~5 minutes on 2 cores, + the torch install
#   bash bench/cpu_suite.sh --quick --repeats 1 --out /tmp/q  # small shapes: proves it runs, no figures
#
# Options: --build DIR (default build), --out DIR (default bench-cpu-suite; must not hold a run),
# --repeats N (alternating repetitions, default 5), --inner N (each run is the best of N, as
# `bench kernel --repeats N`, timed after its one untimed warm-up call at the same shape, as
# torch_sdpa.py warms torch up; default 1), --quick, --torch-python PY (an interpreter that already
# has torch: no venv, no pip), --venv DIR (default .venv-torch), --torch-version V (default
# 2.15.0), --no-torch, --ggml BIN (also time ggml's CPU flash attention, forward, 1 and 2 threads,
# K/V fp32 and fp16, with BIN built from bench/ggml_fa.cc against your own ggml checkout; see
# that file -- this suite never fetches or builds ggml).
# Exit: 0 all runs done, 1 a run failed (its log is in OUT/logs), 2 usage.
set -uo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
BUILD=$ROOT/build OUT=bench-cpu-suite REPEATS=5 INNER=1 QUICK=0 NO_TORCH=0
TORCH_PY="" VENV=$ROOT/.venv-torch TORCH_PIN=2.15.0 GGML_BIN=""

usage() { sed -n '2,/^set -uo/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'; }
die() { echo "cpu_suite.sh: error: $*" >&2; exit 2; }
note() { echo "[$(date -u +%H:%M:%S)] $*" >&2; }
need_value() { [ $# -ge 2 ] && [ -n "$2" ] || die "$1 needs a value (see --help)"; }
count() {  # count NAME VALUE: a whole number >= 1
  [[ $2 =~ ^[0-9]+$ ]] && [ "$2" -ge 1 ] || die "$1 must be a whole number >= 1 (got '$2')"
}

while [ $# -gt 0 ]; do
  case $1 in
    --build) need_value "$@"; BUILD=$2; shift 2 ;;
    --out) need_value "$@"; OUT=$2; shift 2 ;;
    --repeats) need_value "$@"; count "$1" "$2"; REPEATS=$2; shift 2 ;;
    --inner) need_value "$@"; count "$1" "$2"; INNER=$2; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --torch-python) need_value "$@"; TORCH_PY=$2; shift 2 ;;
    --venv) need_value "$@"; VENV=$2; shift 2 ;;
    --torch-version) need_value "$@"; TORCH_PIN=$2; shift 2 ;;
    --no-torch) NO_TORCH=1; shift ;;
    --ggml) need_value "$@"; GGML_BIN=$2; shift 2 ;;
    -h|--help) usage; exit 0 ;;
    *) die "unknown option '$1' (see --help)" ;;
  esac
done

CTXPAR=$BUILD/ctxpar
[ -x "$CTXPAR" ] || die "no ctxpar command at $CTXPAR: build it first (bash scripts/build.sh, or
  cmake -S . -B build -G Ninja -DCMAKE_BUILD_TYPE=Release && cmake --build build --target ctxpar_cli),
  or point --build at the build folder that has it"
"$CTXPAR" --version > /dev/null 2>&1 || die "$CTXPAR --version failed: is the build complete?"
command -v python3 > /dev/null || die "python3 not on PATH (the report and the torch venv need it)"
[ -z "$TORCH_PY" ] || [ "$NO_TORCH" = 0 ] || die "--torch-python and --no-torch exclude each other"
if [ -n "$GGML_BIN" ]; then
  [ -x "$GGML_BIN" ] || die "--ggml $GGML_BIN is not an executable file (build it from bench/ggml_fa.cc: see its comment)"
  "$GGML_BIN" --seq 64 --heads 1 --head-dim 64 --threads 1 > /dev/null 2>&1 ||
    die "--ggml $GGML_BIN failed a 64-token trial run: is it bench/ggml_fa.cc built against ggml?"
fi
[ ! -e "$OUT/raw" ] || die "$OUT already holds a run ($OUT/raw); choose another --out or remove it"
mkdir -p "$OUT/raw" "$OUT/logs" "$OUT/info" || die "cannot create $OUT"
INFO=$OUT/info

# --- the machine and the build --------------------------------------------------------------
date -u +%Y-%m-%dT%H:%M:%SZ > "$INFO/date"
cut -d' ' -f1-3 /proc/loadavg > "$INFO/loadavg_start"
LC_ALL=C lscpu > "$INFO/lscpu.txt" 2>&1 || echo "lscpu failed" > "$INFO/lscpu.txt"
"$CTXPAR" --version > "$INFO/ctxpar_version.txt" 2>&1
git -C "$ROOT" rev-parse --short HEAD > "$INFO/git_commit" 2>/dev/null || echo unknown > "$INFO/git_commit"
git -C "$ROOT" status --porcelain --untracked-files=no 2>/dev/null | grep -q . && echo "(+ local changes)" >> "$INFO/git_commit"

# --- torch: its own venv with the pinned wheel, or SKIP with the reason -----------------------
skip_torch() { echo "$*" > "$INFO/torch_skipped"; note "torch rows SKIPPED: $*"; }
torch_has_pin() {  # the interpreter's torch is the pinned version (a local +cuXXX tag aside)
  "$1" -c "import sys, torch; sys.exit(torch.__version__.split('+')[0] != '$TORCH_PIN')" 2>/dev/null
}
if [ "$NO_TORCH" = 1 ]; then
  skip_torch "--no-torch given"
elif [ -n "$TORCH_PY" ]; then
  "$TORCH_PY" -c "import torch" > "$OUT/logs/torch_python.log" 2>&1 ||
    die "--torch-python $TORCH_PY cannot import torch ($(tail -n1 "$OUT/logs/torch_python.log"))"
else
  TORCH_PY=$VENV/bin/python
  if [ ! -x "$TORCH_PY" ]; then
    note "creating the venv $VENV with $(command -v python3)"
    python3 -m venv "$VENV" > "$OUT/logs/venv.log" 2>&1 ||
      skip_torch "python3 -m venv $VENV failed: $(tail -n1 "$OUT/logs/venv.log") (Debian: apt-get install python3-venv)"
  fi
  if [ ! -e "$INFO/torch_skipped" ] && ! torch_has_pin "$TORCH_PY"; then
    # PyPI's Linux wheel brings the CUDA libraries (~5 GB installed); they are not loaded on a CPU.
    note "pip install torch==$TORCH_PIN numpy into $VENV (log: $OUT/logs/pip.log)"
    "$TORCH_PY" -m pip install --disable-pip-version-check --retries 2 --timeout 60 \
      "torch==$TORCH_PIN" numpy > "$OUT/logs/pip.log" 2>&1 ||
      skip_torch "pip install torch==$TORCH_PIN failed (is PyPI reachable?): $(grep -m1 -i error "$OUT/logs/pip.log" || tail -n1 "$OUT/logs/pip.log")"
  fi
fi
if [ ! -e "$INFO/torch_skipped" ]; then
  "$TORCH_PY" "$ROOT/bench/torch_sdpa.py" --info > "$INFO/torch.json" 2> "$OUT/logs/torch_info.log" ||
    skip_torch "$TORCH_PY bench/torch_sdpa.py --info failed: $(tail -n1 "$OUT/logs/torch_info.log")"
fi

# --- the runs ---------------------------------------------------------------------------------
if [ "$QUICK" = 1 ]; then
  KT=512 KH=2 KD=64 CT=2048 CH=2 CD=64 DC=4K DS=64
else
  KT=4096 KH=8 KD=128 CT=16384 CH=4 CD=128 DC=128K DS=0
fi
# torch_bthd_*: torch's SDPA on [B, T, H, D] storage (the transposed views a model's projections
# hand it, and the memory ctxpar's kernel reads here) beside torch_* on its own [B, H, T, D].
RUNS=(kernel_1t torch_1t kernel_2t torch_2t kernel_bf16_1t torch_bf16_1t kernel_bf16_2t torch_bf16_2t
      torch_bthd_1t torch_bthd_2t torch_bthd_bf16_1t
      ring_p2_zigzag ring_p2_contiguous one_rank_2t decode_1t)
[ -e "$INFO/torch_skipped" ] && RUNS=(kernel_1t kernel_2t ring_p2_zigzag ring_p2_contiguous one_rank_2t decode_1t)
[ -n "$GGML_BIN" ] && RUNS+=(ggml_1t ggml_2t ggml_f16_2t)
# bf16 inputs with the exact bf16 products forced on (CTXPAR_BF16_PRODUCTS=on), beside
# kernel_bf16_1t (what the probe chose: fp32 products on a CPU where vdpbf16ps is slower).
# Both tiers (the default exact one, the opt-in --bf16-tier fast), beside fp32 products forced
# (off); and through AMX-BF16 tiles (CTXPAR_BF16_PRODUCTS=amx) where the CPU has them.
grep -qw avx512_bf16 /proc/cpuinfo && RUNS+=(kernel_bf16dot_1t kernel_bf16dotfast_1t kernel_bf16fp32_1t)
grep -qw amx_bf16 /proc/cpuinfo && RUNS+=(kernel_bf16amx_1t kernel_bf16amxfast_1t)
# fp32 inputs through AMX tiles on three bf16 parts (opt-in: CTXPAR_FP32_PRODUCTS=parts), beside
# kernel_1t / kernel_2t (fp32 FMAs) and torch's fp32 rows, where the CPU has AMX-BF16.
grep -qw amx_bf16 /proc/cpuinfo && RUNS+=(kernel_fp32parts_1t kernel_fp32parts_2t)
python3 - "$INFO/config.json" "$REPEATS" "$INNER" "$QUICK" "$TORCH_PIN" "$TORCH_PY" \
  "$KT" "$KH" "$KD" "$CT" "$CH" "$CD" "$GGML_BIN" "${RUNS[@]}" <<'PY' || die "cannot write $INFO/config.json"
import json, sys
a = sys.argv[1:]
shape = lambda t, h, d: dict(seq=int(t), heads=int(h), head_dim=int(d))
json.dump(dict(repeats=int(a[1]), inner=int(a[2]), quick=a[3] == "1", torch_pin=a[4],
               torch_python=a[5], kernel_shape=shape(*a[6:9]), cp_shape=shape(*a[9:12]),
               ggml_binary=a[12] or None, runs=a[13:]), open(a[0], "w"), indent=1)
PY

export OMP_NUM_THREADS=1  # every command below sets its own thread count
kernel() {  # kernel THREADS [DTYPE [BF16_TIER]]
  "$CTXPAR" bench kernel --seq $KT --heads $KH --head-dim $KD --threads "$1" --dtype "${2:-fp32}" \
    --bf16-tier "${3:-exact}" --repeats "$INNER" --json
}
peak() {  # peak THREADS: the FMA peak alone, as each kernel run measures it in its own process
  "$CTXPAR" bench kernel --peak-only --threads "$1" --repeats 1 --json
}
torch_sdpa() {  # torch_sdpa THREADS [DTYPE [MEMORY]]: its JSON with the FMA peak right before and after
  local before after result
  before=$(peak "$1") || return 1
  result=$(OMP_NUM_THREADS=$1 MKL_NUM_THREADS=$1 "$TORCH_PY" "$ROOT/bench/torch_sdpa.py" --seq $KT \
    --heads $KH --head-dim $KD --threads "$1" --dtype "${2:-fp32}" --memory "${3:-bhtd}" \
    --repeats "$INNER") || return 1
  after=$(peak "$1") || return 1
  python3 -c 'import json, sys
r = json.loads(sys.argv[1])
r["peak_gflops_before"], r["peak_gflops_after"] = (json.loads(a)["peak_gflops"] for a in sys.argv[2:])
print(json.dumps(r))' "$result" "$before" "$after"
}
ggml_fa() {  # ggml_fa THREADS KV: bench/ggml_fa.cc's binary, same kernel shape
  OMP_NUM_THREADS=$1 "$GGML_BIN" --seq $KT --heads $KH --head-dim $KD --threads "$1" --kv "$2" --repeats "$INNER"
}
attention() {
  "$CTXPAR" attention --seq $CT --heads $CH --head-dim $CD --mask causal --strategy ring \
    --repeats "$INNER" --json "$@"
}
run() {  # run NAME: one measurement, its JSON kept only if it succeeded
  case $1 in
    kernel_1t) kernel 1 ;;
    kernel_2t) kernel 2 ;;
    torch_1t) torch_sdpa 1 ;;
    torch_2t) torch_sdpa 2 ;;
    kernel_bf16_1t) kernel 1 bf16 ;;
    kernel_bf16_2t) kernel 2 bf16 ;;
    kernel_bf16dot_1t) CTXPAR_BF16_PRODUCTS=on kernel 1 bf16 ;;
    kernel_bf16dotfast_1t) CTXPAR_BF16_PRODUCTS=on kernel 1 bf16 fast ;;
    kernel_bf16amx_1t) CTXPAR_BF16_PRODUCTS=amx kernel 1 bf16 ;;
    kernel_bf16amxfast_1t) CTXPAR_BF16_PRODUCTS=amx kernel 1 bf16 fast ;;
    kernel_bf16fp32_1t) CTXPAR_BF16_PRODUCTS=off kernel 1 bf16 ;;
    kernel_fp32parts_1t) CTXPAR_FP32_PRODUCTS=parts kernel 1 ;;
    kernel_fp32parts_2t) CTXPAR_FP32_PRODUCTS=parts kernel 2 ;;
    torch_bf16_1t) torch_sdpa 1 bf16 ;;
    torch_bf16_2t) torch_sdpa 2 bf16 ;;
    torch_bthd_1t) torch_sdpa 1 fp32 bthd ;;
    torch_bthd_2t) torch_sdpa 2 fp32 bthd ;;
    torch_bthd_bf16_1t) torch_sdpa 1 bf16 bthd ;;
    ring_p2_zigzag) attention --ranks 2 --threads 1 --layout zigzag ;;
    ring_p2_contiguous) attention --ranks 2 --threads 1 --layout contiguous ;;
    one_rank_2t) attention --ranks 1 --threads 2 ;;
    decode_1t) "$CTXPAR" bench decode --context $DC --dtype fp32 --threads 1 --repeats 3 \
      --stream-mib $DS --json ;;  # DS 0: 4x the last-level cache
    ggml_1t) ggml_fa 1 f32 ;;
    ggml_2t) ggml_fa 2 f32 ;;
    ggml_f16_2t) ggml_fa 2 f16 ;;
  esac
}

FAILED=0
for ((rep = 1; rep <= REPEATS; rep++)); do
  dir=$OUT/raw/rep$rep
  mkdir -p "$dir"
  order=("${RUNS[@]}")
  if ((rep % 2 == 0)); then  # alternate: every other repetition runs the list backwards
    for ((i = 0; i < ${#RUNS[@]}; i++)); do order[i]=${RUNS[${#RUNS[@]} - 1 - i]}; done
  fi
  for name in "${order[@]}"; do
    note "repetition $rep/$REPEATS: $name"
    if run "$name" > "$dir/$name.tmp" 2> "$OUT/logs/rep${rep}_$name.log" && [ -s "$dir/$name.tmp" ]; then
      mv "$dir/$name.tmp" "$dir/$name.json"
    else
      FAILED=1
      mv "$dir/$name.tmp" "$OUT/logs/rep${rep}_$name.stdout" 2>/dev/null
      note "FAILED: $name (repetition $rep): $(tail -n1 "$OUT/logs/rep${rep}_$name.log")"
    fi
  done
done
cut -d' ' -f1-3 /proc/loadavg > "$INFO/loadavg_end"

python3 "$ROOT/bench/cpu_suite_report.py" "$OUT" | tee "$OUT/table.txt"
report=${PIPESTATUS[0]}
[ "$report" = 0 ] || [ "$report" = 1 ] || die "the report failed (exit $report)"
exit $((FAILED || report))
