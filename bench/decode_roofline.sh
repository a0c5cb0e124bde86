#!/usr/bin/env bash
# Decode at the memory roofline (docs/BENCHMARKS.md, "Decode at the memory roofline"): REPEATS
# alternating runs of `ctxpar bench decode` (the in-place kernel and the tile path, against the
# read bandwidth of the same threads, all in one process; then the in-place kernel alone, one
# cache in memory as torch's run holds one: the torch column compares these) and
# bench/torch_decode.py (torch's SDPA, same shape), then the medians over the runs. Hq 8, Hkv 2,
# D 128, one token, THREADS threads.
#   bash bench/decode_roofline.sh [CONTEXTS [REPEATS [THREADS [PYTHON]]]]
#   bash bench/decode_roofline.sh 32K,128K,1M 3 1 .venv/bin/python
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CONTEXTS=${1:-32K,128K} REPEATS=${2:-3} THREADS=${3:-1} PY=${4:-$ROOT/.venv/bin/python}
OUT=$(mktemp -d)
torch_contexts=$(python3 -c "import sys; print(','.join(str(int(x[:-1]) * {'K': 1024, 'M': 1048576}[x[-1]] if x[-1] in 'KM' else int(x)) for x in sys.argv[1].split(',')))" "$CONTEXTS")
for ((r = 1; r <= REPEATS; r++)); do
  OMP_NUM_THREADS=$THREADS "$ROOT/build/ctxpar" bench decode --context "$CONTEXTS" --threads "$THREADS" --json > "$OUT/ctxpar$r.json"
  # The in-place kernel alone (one cache in memory, as torch's run holds one): the torch column.
  OMP_NUM_THREADS=$THREADS "$ROOT/build/ctxpar" bench decode --context "$CONTEXTS" --threads "$THREADS" --no-reference --json > "$OUT/alone$r.json"
  if [ -x "$PY" ]; then
    "$PY" "$ROOT/bench/torch_decode.py" --context "$torch_contexts" --threads "$THREADS" > "$OUT/torch$r.json" || true
  fi
done
python3 - "$OUT" "$REPEATS" <<'PY'
import glob, json, os, statistics as st, sys
out, reps = sys.argv[1], int(sys.argv[2])
load = lambda p: json.load(open(p)) if os.path.exists(p) and os.path.getsize(p) else None
ours = [load(f"{out}/ctxpar{r}.json") for r in range(1, reps + 1)]
alone = [load(f"{out}/alone{r}.json") for r in range(1, reps + 1)]
torch = [t for t in (load(f"{out}/torch{r}.json") for r in range(1, reps + 1)) if t]
print(f"median of {reps} alternating runs (each ctxpar run: median of its own 5 tokens)")
print("dtype  context  STREAM GB/s | in place ms  GB/s  /STREAM | tiles ms  GB/s  /STREAM | new/old | alone ms /STREAM | torch ms  GB/s  torch/alone")
for i, row in enumerate(ours[0]["rows"]):
    m = lambda k: st.median(o["rows"][i][k] for o in ours)
    a = lambda k: st.median(o["rows"][i][k] for o in alone)
    tm = [t["rows"][i]["seconds"] for t in torch if len(t["rows"]) > i]
    tt = f"{st.median(tm) * 1e3:8.1f} {row['cache_bytes_per_token'] / st.median(tm) / 1e9:5.2f} {st.median(tm) / a('in_place_seconds'):11.2f}" if tm else "     n/a"
    print(f"{row['dtype']:5} {row['context']:8} {m('stream_bytes_per_second') / 1e9:12.2f} | "
          f"{m('in_place_seconds') * 1e3:11.1f} {m('in_place_bytes_per_second') / 1e9:5.2f} {m('in_place_of_stream'):8.2f} | "
          f"{m('tiles_seconds') * 1e3:8.1f} {m('tiles_bytes_per_second') / 1e9:5.2f} {m('tiles_of_stream'):8.2f} | "
          f"{m('in_place_over_tiles'):7.2f} | {a('in_place_seconds') * 1e3:8.1f} {a('in_place_of_stream'):7.2f} | {tt}")
PY
rm -rf "$OUT"
