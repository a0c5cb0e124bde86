#!/usr/bin/env bash
# Ring overlap over a real network: MPI ranks talk TCP through the loopback of a
# network namespace whose link is shaped with `tc tbf`, under each MPI progress mode asked for
# (CTXPAR_MPI_PROGRESS: off, thread, tiles, both; docs/comm.md, "Progress"). Prints, per run, the transfer time the shaped link implies and how much of it each rank
# waited for (comm_wait_seconds); every figure is a ratio measured in the same run.
#
#   bench/net_overlap.sh [--ctxpar build/ctxpar] [--ranks "2 4"] [--rate-per-rank 50]
#       [--seq-per-rank 4096] [--heads 8] [--progress "off thread tiles"] [--out bench-net]
#       [-- ctxpar args]
#
# --progress: the modes to run, in order, each on the same shaped link ("off thread tiles"
# compares the progress thread with the kernel's tile hook).
# Ranks share one loopback, so lo is shaped to P x rate-per-rank Mbit/s: each rank's ring
# transfer then gets the share a link of rate-per-rank would give it. Sequence = seq-per-rank
# x P, so every P computes and sends the same per step. Default problem: --heads 8 --kv-heads 1
# --head-dim 64 --mask none (--heads sets the compute; the K/V block does not change) (forward; add `-- --backward` for both passes); extra arguments
# after `--` are appended to `ctxpar attention`.
#
# Needs root (or CAP_NET_ADMIN), iproute2's `ip` and `tc`, and mpirun; without them it prints
# "SKIP: <why>" and exits 77. The namespace (ctxpar-net-<pid>) is deleted on exit, and
# namespaces left by a killed run are deleted by the next one. See docs/BENCHMARKS.md.
set -euo pipefail

CTXPAR=build/ctxpar
RANKS="2 4"
RATE=50          # Mbit/s per rank
SEQ_PER_RANK=4096
HEADS=8
MODES="off thread tiles"
OUT=bench-net
RUN_TIMEOUT=300  # seconds per mpirun
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --ctxpar) CTXPAR=$2; shift 2 ;;
    --ranks) RANKS=$2; shift 2 ;;
    --rate-per-rank) RATE=$2; shift 2 ;;
    --seq-per-rank) SEQ_PER_RANK=$2; shift 2 ;;
    --heads) HEADS=$2; shift 2 ;;
    --progress) MODES=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --run-timeout) RUN_TIMEOUT=$2; shift 2 ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "net_overlap.sh: unknown option '$1' (see the header of $0 for the options)" >&2
       exit 2 ;;
  esac
done

for mode in $MODES; do
  case "$mode" in
    off|thread|tiles|both) ;;
    *) echo "net_overlap.sh: --progress: unknown mode '$mode'; use off, thread, tiles or both (CTXPAR_MPI_PROGRESS)" >&2
       exit 2 ;;
  esac
done
[ -x "$CTXPAR" ] || { echo "net_overlap.sh: --ctxpar $CTXPAR is not an executable (build it: cmake --build build --target ctxpar_cli)" >&2; exit 2; }
. "$(dirname "$0")/netns.sh"
netns_create
NETNS_TIMEOUT=$RUN_TIMEOUT
mkdir -p "$OUT"
for p in $RANKS; do
  total=$((RATE * p))
  netns_shape "$total"
  for mode in $MODES; do
    file="$OUT/p${p}_${mode}.json"
    echo "P=$p progress=$mode, lo shaped to ${total} Mbit/s ($RATE per rank) -> $file" >&2
    CTXPAR_MPI_PROGRESS="$mode" netns_mpirun "$p" \
        "$CTXPAR" attention --seq $((SEQ_PER_RANK * p)) --heads "$HEADS" --kv-heads 1 --head-dim 64 \
        --mask none --json "${EXTRA[@]}" > "$file"
    echo "$total" > "$OUT/p${p}_${mode}.mbit"
  done
done

# Transfer time: every rank's bytes cross the one shaped loopback, so a blocking exchange
# exposes sum(bytes_sent) / rate per rank (for the ring: P-1 steps of one block at the
# per-rank rate). exposed = (forward + backward seconds - the busiest rank's busy_seconds in
# each pass, summed over the passes - bookkeeping) / transfer: how much longer the job took
# than its compute's critical path (each pass ends with its busiest rank, and with four ranks
# on two cores that is not the same rank in both: one CI run took the busiest rank's total and
# read 0.28 where the passes read 0.04 and 0.03), i.e.
# the communication left on the critical path; bookkeeping = the least time any rank spent
# neither in kernels nor waiting (packing blocks, finalising: ~20-50 ms here), which is not
# communication. (A rank's own comm_wait is no such measure: it also
# holds waiting for a slower neighbour to forward a block, when ranks share cores unevenly,
# and the two directions of a shared link need not finish together.) Median and max of
# comm_wait / transfer over ranks are printed too. compute_ratio = a step's transfer / the median rank's busy time per step
# (below 1: the transfer can hide). step_over_transfer = (forward - one step's compute) /
# (P - 1) / a step's transfer: every step after the first waits for its block, so when the
# transfer is longer than the compute this is ~1 when the step is as fast as the link allows.
/usr/bin/env python3 - "$OUT" $RANKS -- $MODES <<'PY'
import json, os, statistics, sys
out = sys.argv[1]
sep = sys.argv.index("--")
ranks, modes = sys.argv[2:sep], sys.argv[sep + 1:]
f3 = lambda x: "n/a" if x is None else f"{x:.3f}"
summary = []
for p in ranks:
    for mode in modes:
        base = os.path.join(out, f"p{p}_{mode}")
        j = json.load(open(base + ".json"))
        mbit = float(open(base + ".mbit").read())
        P = int(p)
        rate = mbit * 1e6 / 8  # bytes/s through the one shaped loopback
        R = j["ranks"]
        # Forward bytes are the ring's P-1 K/V blocks a rank (fp32 here, no document ids);
        # backward's are the rest (K/V again and the fp32 dK/dV accumulators).
        tl = j["seq"] // P
        kv_block = 2 * j["batch"] * tl * j["kv_heads"] * j["head_dim"] * (2 if j["dtype"] == "bf16" else 4) + 8 * tl
        fwd_bytes = P * (P - 1) * kv_block
        total_bytes = sum(r["bytes_sent"] for r in R)
        transfer = total_bytes / rate
        waits = [r["comm_wait_seconds"] for r in R]
        if all("forward_busy_seconds" in r for r in R):
            busiest = sum(max(r[n + "_busy_seconds"] for r in R)
                          for n in ("forward", "backward") if j["backward"] or n == "forward")
        else:
            busiest = max(r["busy_seconds"] for r in R)
        elapsed = j["forward_seconds"] + j["backward_seconds"]
        bookkeeping = min(r["wall_seconds"] - r["busy_seconds"] - r["comm_wait_seconds"] for r in R)
        row = {"ranks": P, "progress": mode, "link_mbit_per_rank": mbit / P,
               "transfer_seconds": transfer,
               "forward_seconds": j["forward_seconds"], "backward_seconds": j["backward_seconds"],
               "comm_wait_seconds": waits,
               # the whole run: time beyond the busiest rank's compute and the bookkeeping
               "exposed": max(0.0, elapsed - busiest - bookkeeping) / transfer,
               "exposed_median": statistics.median(waits) / transfer,
               "exposed_max": max(waits) / transfer}
        # Per pass (P > 1): a step's transfer / a step's compute (median rank), the pass's
        # time beyond its busiest rank's compute / the pass's transfer (bookkeeping included:
        # an upper bound), and (pass - one step's compute) / (P - 1) / a step's transfer.
        passes = [("forward", fwd_bytes)] + ([("backward", total_bytes - fwd_bytes)] if j["backward"] else [])
        for name, nbytes in passes:
            busy = [r[name + "_busy_seconds"] for r in R]
            step_c = statistics.median(busy) / P
            t = nbytes / rate
            ok = P > 1 and t > 0 and step_c > 0
            row[name] = {
                "transfer_seconds": t,
                "compute_ratio": t / (P - 1) / step_c if ok else None,
                "exposed": max(0.0, j[name + "_seconds"] - max(busy)) / t if ok else None,
                "step_over_transfer": (j[name + "_seconds"] - step_c) / t if ok else None}
        summary.append(row)
        per_pass = "; ".join(
            f"{n}: transfer x{f3(row[n]['compute_ratio'])} of a step's compute, exposed "
            f"{f3(row[n]['exposed'])}, step / transfer {f3(row[n]['step_over_transfer'])}"
            for n, _ in passes)
        print(f"P={P} progress={mode:6} transfer {transfer:.3f} s  forward {j['forward_seconds']:.3f} s"
              f"  backward {j['backward_seconds']:.3f} s  exposed {row['exposed']:.3f} of the transfer "
              f"(waits: median {row['exposed_median']:.3f}, max {row['exposed_max']:.3f}) | {per_pass}")
json.dump(summary, open(os.path.join(out, "summary.json"), "w"), indent=1)
PY
