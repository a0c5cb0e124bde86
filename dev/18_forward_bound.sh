#!/usr/bin/env bash
# Lab 18: how far the bf16 fast tier's forward can go on an AMX CPU, measured in place (issue 40).
#
# Builds the library's `ctxpar` with dev/18_forward_bound.patch applied (a measurement-only
# switch in the AMX key step, `CTXPAR_LAB_SKIP`: 1 skips the online softmax and P's rounding to
# pairs, 2 skips the S and P V tile products, 3 both; everything else, packing, masks, tasks, the
# finalize, runs as always; results are wrong where anything is skipped) in a worktree of HEAD,
# never in this tree, and alternates in each round
#   full      the fast tier's forward as the library runs it (CTXPAR_LAB_SKIP=0),
#   products  the same without the softmax: S and P V tile products in place (1),
#   softmax   the same without the tile products: the vector work in place (2),
#   rest      neither: packing, masks, tasks, finalize (3),
#   torch     torch's bf16 SDPA forward (bench/torch_sdpa.py),
# at the CPU suite's shape (T = 4096, H = 8, D = 128, one thread; best of 2 within a round, wall
# time on both sides; torch's forward is a training step's), then prints the medians, each
# phase alone (products - rest, softmax - rest), what running them in one thread adds (full minus
# the three), and what 1.5 x torch leaves the softmax beside the products as they run in place.
# docs/kernel.md, "Round fifteen".
#
#   dev/18_forward_bound.sh [rounds (5)] [torch python (.venv/bin/python)]
# Exits 0 with a note where AMX-BF16 is not usable; the worktree and its build stay in
# ${CTXPAR_LAB_DIR:-/tmp/ctxpar-lab18} for reruns (delete it with `git worktree remove --force DIR`).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
ROUNDS=${1:-5}
TORCH_PY=${2:-$ROOT/.venv/bin/python}
DIR=${CTXPAR_LAB_DIR:-/tmp/ctxpar-lab18}
T=4096 H=8 D=128
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] ||
  { echo "lab 18: rounds must be a whole number >= 1 (got '$ROUNDS'); usage: $0 [rounds] [torch python]" >&2; exit 2; }

if ! grep -qw amx_bf16 /proc/cpuinfo; then
  echo "lab 18: this CPU has no AMX-BF16; the fast tier's AMX forward does not run here"
  exit 0
fi
[[ -x $TORCH_PY ]] || { echo "lab 18: no python at $TORCH_PY (give one with torch as the second argument)" >&2; exit 2; }

# The worktree at this tree's HEAD (commit first: uncommitted changes are not in it), patched afresh.
[[ -d $DIR ]] || git -C "$ROOT" worktree add --detach "$DIR" HEAD >/dev/null
git -C "$DIR" checkout -q -f --detach "$(git -C "$ROOT" rev-parse HEAD)"
git -C "$DIR" apply "$ROOT/dev/18_forward_bound.patch" || {
  echo "lab 18: dev/18_forward_bound.patch no longer applies to HEAD's src/kernel/simd_forward.cc;" \
    "make the same three skips by hand there and save 'git diff' over the patch" >&2
  exit 2
}
launcher=()
command -v ccache >/dev/null && launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache)
[[ -f $DIR/build/build.ninja ]] || cmake -S "$DIR" -B "$DIR/build" -G Ninja -DCMAKE_BUILD_TYPE=Release \
  "${launcher[@]}" >/dev/null
ninja -C "$DIR/build" ctxpar >/dev/null
BIN=$DIR/build/ctxpar

ctxpar_ms() {  # ctxpar_ms SKIP: "forward causal" in ms (wall, as torch_sdpa.py times torch)
  CTXPAR_LAB_SKIP=$1 CTXPAR_BF16_PRODUCTS=amx "$BIN" bench kernel --seq $T --heads $H --head-dim $D \
    --threads 1 --dtype bf16 --bf16-tier fast --repeats 2 --no-backward --json |
    python3 -c 'import json, sys
r = json.load(sys.stdin); f = 4.0 * r["heads"] * r["seq"] ** 2 * r["head_dim"]
print("%.1f %.1f" % (1e3 * f / r["fwd_gflops"] / 1e9, 1e3 * f / 2 / r["causal_fwd_gflops"] / 1e9))'
}
torch_ms() {
  OMP_NUM_THREADS=1 "$TORCH_PY" "$ROOT/bench/torch_sdpa.py" --seq $T --heads $H --head-dim $D \
    --threads 1 --dtype bf16 --repeats 2 2>/dev/null |
    python3 -c 'import json, sys
r = json.load(sys.stdin); print("%.1f %.1f" % (1e3 * r["fwd_seconds"], 1e3 * r["causal_fwd_seconds"]))'
}

OUT=$(mktemp)
echo "lab 18:$(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2-), T=$T H=$H D=$D, 1 thread, ms a forward (non-causal causal)"
for ((i = 1; i <= ROUNDS; ++i)); do
  for s in 0 1 2 3; do
    name=(full products softmax rest)
    echo "${name[$s]} $(ctxpar_ms $s)" | tee -a "$OUT"
  done
  echo "torch $(torch_ms)" | tee -a "$OUT"
done
python3 - "$OUT" <<'PY'
import statistics, sys
rows = {}
for line in open(sys.argv[1]):
    name, *ms = line.split()
    rows.setdefault(name, []).append([float(x) for x in ms])
med = {n: [statistics.median(r[i] for r in v) for i in range(2)] for n, v in rows.items()}
for i, mask in enumerate(("non-causal", "causal")):
    f, p, s, c, t = (med[n][i] for n in ("full", "products", "softmax", "rest", "torch"))
    need = t / 1.5
    print(f"{mask}, medians (ms): full {f:.1f}, torch {t:.1f} (ctxpar / torch {t / f:.2f}); rest {c:.1f},"
          f" products {p - c:.1f}, softmax {s - c:.1f}, one thread running both adds {f - p - s + c:.1f};"
          f" 1.5 x torch needs <= {need:.1f}: beside the rest and the products as they run, the"
          f" softmax would have {need - p:.1f} (it takes {s - c:.1f} alone)")
PY
rm -f "$OUT"
