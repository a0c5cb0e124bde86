#!/usr/bin/env bash
# The planner against the ring over a shaped TCP link (the goal: "ctxpar plan --hardware
# local learns the MPI/TCP link and predicts these runs within 15 %"). For each case (P,
# heads), alternating `--repeats` times: `ctxpar plan --hardware local` under mpirun in the
# shaped namespace (it times each rank's kernel and a ring shift of one K/V block over the
# link), then the run itself (`ctxpar attention`, forward [+ backward]); prints predicted /
# measured per pair and the median and spread per case. Same problem as bench/net_overlap.sh
# (--kv-heads 1 --head-dim 64 --mask none, seq = seq-per-rank x P, lo shaped to P x rate).
#
#   bench/net_plan.sh [--ctxpar build/ctxpar] [--cases "2:9 2:4 4:6 4:2"] [--rate-per-rank 50]
#       [--seq-per-rank 4096] [--repeats 5] [--backward] [--out bench-net-plan]
#
# A case P:H uses P ranks and H query heads (the compute; the K/V block does not change).
# Needs root (namespaces); otherwise prints "SKIP: <why>" and exits 77.
set -euo pipefail

CTXPAR=build/ctxpar
CASES="2:9 2:4 4:6 4:2"
RATE=50
SEQ_PER_RANK=4096
REPEATS=5
BACKWARD=0
OUT=bench-net-plan
while [ $# -gt 0 ]; do
  case "$1" in
    --ctxpar) CTXPAR=$2; shift 2 ;;
    --cases) CASES=$2; shift 2 ;;
    --rate-per-rank) RATE=$2; shift 2 ;;
    --seq-per-rank) SEQ_PER_RANK=$2; shift 2 ;;
    --repeats) REPEATS=$2; shift 2 ;;
    --backward) BACKWARD=1; shift ;;
    --out) OUT=$2; shift 2 ;;
    *) echo "net_plan.sh: unknown option '$1' (see the header of $0 for the options)" >&2
       exit 2 ;;
  esac
done
[ -x "$CTXPAR" ] || { echo "net_plan.sh: --ctxpar $CTXPAR is not an executable (build it first)" >&2; exit 2; }
case "$REPEATS" in ''|*[!0-9]*|0) echo "net_plan.sh: --repeats must be a positive integer, got '$REPEATS'" >&2; exit 2 ;; esac
. "$(dirname "$0")/netns.sh"
netns_create
NETNS_TIMEOUT=300
mkdir -p "$OUT"
bwd=()
[ "$BACKWARD" = 1 ] && bwd=(--backward)
for c in $CASES; do
  p=${c%%:*} h=${c##*:}
  netns_shape $((RATE * p))
  shape=(--heads "$h" --kv-heads 1 --head-dim 64 --seq $((SEQ_PER_RANK * p)) --mask none --dtype fp32)
  for i in $(seq 1 "$REPEATS"); do
    echo "P=$p heads=$h repeat $i/$REPEATS" >&2
    # plan's --heads/--kv-heads/--head-dim describe the attention; the model flags are minimal
    # (only the attention layer's time is compared).
    netns_mpirun "$p" "$CTXPAR" plan --hardware local --cp "$p" --layers 1 --hidden 64 \
      --ffn 256 --vocab 1000 --json "${shape[@]}" > "$OUT/p${p}_h${h}_${i}.plan.json"
    netns_mpirun "$p" "$CTXPAR" attention --json "${bwd[@]}" "${shape[@]}" \
      > "$OUT/p${p}_h${h}_${i}.run.json" 2>/dev/null
  done
done
/usr/bin/env python3 - "$OUT" "$BACKWARD" $CASES <<'PY'
import glob, json, os, statistics, sys
out, backward, cases = sys.argv[1], sys.argv[2] == "1", sys.argv[3:]
first = lambda path: json.JSONDecoder().raw_decode(open(path).read().lstrip())[0]  # rank 0
summary = []
for c in cases:
    p, h = c.split(":")
    rows = {"forward": [], "forward + backward": []} if backward else {"forward": []}
    for plan_path in sorted(glob.glob(f"{out}/p{p}_h{h}_*.plan.json")):
        plan, run = first(plan_path), first(plan_path.replace(".plan.json", ".run.json"))
        ring = plan["ring_layer"]
        pairs = {"forward": (ring["forward_seconds"], run["forward_seconds"])}
        if backward:
            pairs["forward + backward"] = (ring["seconds"], run["forward_seconds"] + run["backward_seconds"])
        for what, (pred, meas) in pairs.items():
            rows[what].append(pred / meas)
            print(f"P={p} heads={h} {what}: predicted {pred:.3f} s, measured {meas:.3f} s, ratio {pred / meas:.3f}")
    case = {"ranks": int(p), "heads": int(h)}
    for what, ratios in rows.items():
        med = statistics.median(ratios)
        print(f"P={p} heads={h} {what}: predicted / measured median {med:.3f} (min {min(ratios):.3f}, "
              f"max {max(ratios):.3f}, {len(ratios)} runs) {'within' if abs(med - 1) <= 0.15 else 'OUTSIDE'} 15 %")
        case[what] = {"ratios": ratios, "median": med}
    summary.append(case)
json.dump({"backward": backward, "cases": summary}, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
