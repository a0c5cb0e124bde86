#!/usr/bin/env bash
# bf16 inputs with fp32 products against the exact bf16 products through AMX-BF16
# tiles (and vdpbf16ps where AVX512_BF16, and torch's bf16 SDPA where a python with torch is
# given), one thread, T=4096, H=8, D=128, causal and non-causal, forward and backward.
# Alternating runs (ABC, CBA, ...), medians over REPEATS processes of `bench kernel --repeats 1`;
# wall and CPU-time GFLOP/s both (on a shared machine the CPU-time ratio is the steadier one).
#   bench/bf16_products.sh [CTXPAR_BINARY] [REPEATS] [TORCH_PYTHON]
# e.g. bench/bf16_products.sh build/ctxpar 5 .venv/bin/python
# PRODUCTS="off amx" (say) restricts the kernel runs (default: off, then dot and amx where the
# CPU has them); a run named products/fast (e.g. amx/fast) takes the fast bf16 tier
# (--bf16-tier fast), FAST=1 adds one for each non-off run. Ratios are against off (the exact
# tier with fp32 products): the ratio of the medians, and [the median of the per-repetition
# ratios, whose runs are adjacent in time].
set -euo pipefail
CTXPAR=${1:-build/ctxpar}
REPEATS=${2:-5}
TORCH_PY=${3:-}
ROOT=$(cd "$(dirname "$0")/.." && pwd)
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
RUNS=(off)
grep -qw avx512_bf16 /proc/cpuinfo && RUNS+=(dot)
grep -qw amx_bf16 /proc/cpuinfo && RUNS+=(amx)
[ -n "${PRODUCTS:-}" ] && read -r -a RUNS <<< "$PRODUCTS"
if [ "${FAST:-0}" = 1 ]; then
  for r in "${RUNS[@]}"; do [ "$r" != off ] && [ "${r#*/}" = "$r" ] && RUNS+=("$r/fast"); done
fi
[ -n "$TORCH_PY" ] && RUNS+=(torch)
SHAPE=(--seq 4096 --heads 8 --head-dim 128 --threads 1)
for ((rep = 1; rep <= REPEATS; rep++)); do
  order=("${RUNS[@]}")
  if ((rep % 2 == 0)); then
    for ((i = 0; i < ${#RUNS[@]}; i++)); do order[i]=${RUNS[${#RUNS[@]} - 1 - i]}; done
  fi
  for r in "${order[@]}"; do
    if [ "$r" = torch ]; then
      "$TORCH_PY" "$ROOT/bench/torch_sdpa.py" "${SHAPE[@]}" --dtype bf16 --repeats 1 > "$OUT/$r.$rep.json"
    else
      tier=exact
      [ "${r#*/}" != "$r" ] && tier=${r#*/}
      CTXPAR_BF16_PRODUCTS=${r%%/*} "$CTXPAR" bench kernel "${SHAPE[@]}" --dtype bf16 --repeats 1 \
        --bf16-tier "$tier" --json > "$OUT/${r//\//_}.$rep.json"
    fi
  done
done
python3 - "$OUT" "$REPEATS" "${RUNS[@]}" <<'PY'
import json, statistics, sys
out, reps, runs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
data = {r: [json.load(open(f"{out}/{r.replace('/', '_')}.{i}.json")) for i in range(1, reps + 1)]
        for r in runs}
def med(r, key):
    vals = [d[key] for d in data[r] if key in d]
    return statistics.median(vals) if vals else None
print(f"medians of {reps} alternating runs; GFLOP/s (wall / CPU time); ratios against off: "
      "of the medians [median of the per-repetition ratios]")
def rep_ratio(r, key):
    vals = [a[key] / b[key] for a, b in zip(data[r], data["off"]) if key in a and key in b]
    return statistics.median(vals) if vals else None
for key in ("fwd", "bwd", "causal_fwd", "causal_bwd"):
    line = [f"{key:11s}"]
    for r in runs:
        w, c = med(r, key + "_gflops"), med(r, key + "_gflops_cpu")
        text = f"{r}: {w:.1f}" + (f" / {c:.1f}" if c else "")
        if r != "off":
            text += f" x{w / med('off', key + '_gflops'):.2f} [{rep_ratio(r, key + '_gflops'):.2f}]"
            if c:
                text += (f" cpu x{c / med('off', key + '_gflops_cpu'):.2f}"
                         f" [{rep_ratio(r, key + '_gflops_cpu'):.2f}]")
        line.append(text)
    print("  ".join(line))
PY
