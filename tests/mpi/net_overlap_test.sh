#!/usr/bin/env bash
# CTest `mpi_net_overlap` (label net): ring attention under mpirun over TCP through a shaped
# loopback (bench/net_overlap.sh makes and deletes the namespace) must hide its transfers
# behind compute once MPI progress calls are made (the kernel's tiles or a thread) (Note [MPI progress]).
#
#   net_overlap_test.sh CTXPAR BENCH_SCRIPT OUT_DIR
#
# 1. P = 2 with progress calls off: the baseline. The shaped link must expose at least
#    half of the transfer time it implies (else the link is not shaped and nothing below
#    could be seen: the test fails saying so).
# 2. P = 2 and P = 4 with progress calls from the kernel's tiles (the default), and P = 2 with
#    the progress thread, forward and backward: the exposed
#    communication on the critical path (time minus the busiest rank's compute and the ranks'
#    bookkeeping; see bench/net_overlap.sh) must be at most 25 % of the transfer, for the whole
#    run and for each pass. The goal on a quiet machine is 10 %; 25 % leaves room for a loaded
#    2-core machine (4 ranks oversubscribe it) without letting a blocking exchange (~100 %,
#    step 1) pass, nor a backward whose dK/dV accumulators go home in one piece after the
#    last compute (at P = 2 that hop is half of the backward's bytes: ~50 %). Where a figure
#    comes out over 0.25 the checked runs are made once more and each figure is the lower of
#    the two: a stalled rank on a loaded machine only adds to the exposed time, so a blocking
#    exchange or a one-piece dK/dV hop fails both tries (0.28 was seen once in CI).
#    The thread is not checked at P = 4: four ranks and four progress threads on two cores
#    measure the scheduler (one CI run in five exposed 0.37 of the backward's transfer there,
#    0.05 in the next three); its P = 4 figures are in docs/BENCHMARKS.md, from runs by hand.
# Sizes: 4096 tokens per rank, 16 query heads, 1 K/V head of 64: a 2.1 MB K/V block per step.
# 0. The link rate is calibrated in the same run (net_calibrate.py), so that the test means the
#    same on every CPU: one step of the forward is timed alone in CPU seconds and the link is
#    shaped so that a step's K/V block takes 0.35 of it (~45 Mbit/s a rank on the 2-core Xeon
#    here, 1.1 s a step). On a faster CPU (a Zen 5 with AVX-512: a fixed 50 Mbit/s made the
#    transfer 1.085 x a step's compute and the test skipped) the heads are raised first, so
#    that a step's transfer stays at least 0.3 s, long against the scheduler's noise; then the
#    rate is set the same way. The runs' own ratio (a step's
#    transfer / the median rank's wall compute a step) must come out at most 0.8, else the
#    calibration did not hold and the test fails saying so.
# Exit 77 (CTest skip) only where namespaces, tc or mpirun are not available (bench/netns.sh).
# Not robust to a machine loaded far past its cores: at a load average of 12 on 2 cores (six
# builds beside it) the P = 4 run outlives its 120 s, and the per-pass figures, which keep
# the ranks' bookkeeping, exceed 0.25 on the scheduler's delays alone (0.27-0.35 seen, with
# the whole run's at 0.01-0.15); so it was before calibration.
# CTXPAR_NET_OVERLAP_HEADS=4 starts from 4 heads instead: a step computed as a CPU ~4x faster
# than the Xeon would, the same bytes (before calibration, that skipped here too; now the
# heads are raised back to ~16).
set -euo pipefail
CTXPAR=$1 BENCH=$2 OUT=$3
rm -rf "$OUT"
mkdir -p "$OUT"
heads=${CTXPAR_NET_OVERLAP_HEADS:-16}
[[ "$heads" =~ ^[1-9][0-9]*$ ]] ||
  { echo "CTXPAR_NET_OVERLAP_HEADS='$heads': give a positive number of query heads" >&2; exit 2; }
read -r rate heads < <(python3 "$(dirname "$0")/net_calibrate.py" "$CTXPAR" "$heads")
[ -n "${heads:-}" ] || exit 1   # the calibration said why
common=(--ctxpar "$CTXPAR" --rate-per-rank "$rate" --seq-per-rank 4096 --heads "$heads"
        --run-timeout 120)
# The baseline forces progress off; the checked runs force each mode on, whatever the
# environment says (so `CTXPAR_MPI_PROGRESS=off ctest` cannot turn this test into a no-op).
rc=0
bash "$BENCH" "${common[@]}" --ranks 2 --progress off --out "$OUT/off" -- --backward || rc=$?
[ $rc -eq 0 ] || exit $rc   # 77: skipped, said why
# The checked runs: tiles at P = 2 and 4, the thread at P = 2, each bench call into its own
# folder (run P MODE DIR).
run() {
  local rc=0
  bash "$BENCH" "${common[@]}" --ranks "$1" --progress "$2" --out "$3/$2_p$1" -- --backward || rc=$?
  [ $rc -eq 0 ] || exit $rc   # 77: skipped, said why
}
CHECKED=("2 tiles" "4 tiles" "2 thread")

# check TRY_DIR...: exit 0 (every figure within its limit), 1 (failed), 3 (an exposed figure
# over 0.25: its run is worth one more try; the runs to redo are written to $OUT/redo). Each
# figure is the lowest over the tries that have its run: noise (a stalled rank on a loaded
# machine) only adds to the exposed time, so the lower of two still catches a blocking
# exchange (~1.0) or dK / dV accumulators sent home in one piece (~0.5).
check() {
python3 - "$OUT" "$@" <<'PY'
import json, os, sys
out, tries = sys.argv[1], sys.argv[2:]
off = json.load(open(os.path.join(out, "off", "summary.json")))
checked = [(2, "tiles"), (4, "tiles"), (2, "thread")]
rows = {key: [] for key in checked}  # (ranks, progress) -> its rows over the tries
for t in tries:
    for p, mode in checked:
        f = os.path.join(t, f"{mode}_p{p}", "summary.json")
        if not os.path.exists(f):
            continue
        [row] = json.load(open(f))
        assert (row["ranks"], row["progress"]) == (p, mode), row
        ratio = row["forward"]["compute_ratio"]
        if ratio is None or ratio > 0.8:
            print(f"FAIL: P={p} progress {mode}: a step's transfer came to "
                  f"{ratio} of its compute, calibrated for 0.35 (net_calibrate.py): the runs "
                  "computed much faster than the calibration run")
            sys.exit(1)
        rows[(p, mode)].append(row)
base = off[0]
print(f"baseline P=2 progress off: exposed {base['exposed']:.3f} of {base['transfer_seconds']:.3f} s")
if base["exposed"] < 0.5:
    print("FAIL: without progress calls the shaped link should expose at least half the "
          "transfer; it exposed less, so the link is not shaped as asked (tc tbf) and overlap "
          "cannot be seen")
    sys.exit(1)
redo = []
for (p, mode), runs in rows.items():
    for what in ("forward + backward", "forward", "backward"):
        parts = [r if what == "forward + backward" else r[what] for r in runs]
        part = min(parts, key=lambda x: x["exposed"])
        verdict = "ok" if part["exposed"] <= 0.25 else "FAIL"
        seen = " / ".join(f"{x['exposed']:.3f}" for x in parts)
        print(f"{verdict}: P={p} progress {mode}, {what}: exposed {part['exposed']:.3f} "
              f"of the {part['transfer_seconds']:.3f} s transfer on the critical path (limit 0.25; "
              f"tries: {seen}; compute ratio {runs[0]['forward']['compute_ratio']:.2f} forward, "
              f"{runs[0]['backward']['compute_ratio']:.2f} backward)")
        if verdict != "ok" and f"{p} {mode}" not in redo:
            redo.append(f"{p} {mode}")
with open(os.path.join(out, "redo"), "w") as f:
    f.write("\n".join(redo) + ("\n" if redo else ""))
sys.exit(3 if redo else 0)
PY
}

for c in "${CHECKED[@]}"; do run $c "$OUT/try1"; done
rc=0
check "$OUT/try1" || rc=$?
if [ $rc -eq 3 ]; then
  echo "an exposed figure was over 0.25: its run once more, each figure the lower of two"
  mapfile -t redo < "$OUT/redo"  # (not a while-read loop: mpirun would read its stdin)
  for c in "${redo[@]}"; do run $c "$OUT/try2"; done
  rc=0
  check "$OUT/try1" "$OUT/try2" || rc=$?
fi
[ $rc -eq 0 ] || exit 1
