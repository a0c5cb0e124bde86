#!/usr/bin/env python3
"""Calibrates the shaped link of tests/mpi/net_overlap_test.sh to this CPU.

    net_calibrate.py CTXPAR HEADS   ->  prints "RATE_MBIT_PER_RANK HEADS" on stdout

One step of the ring's forward (a rank's 4096 queries against one block of 4096 keys, 1 K/V
head of 64, no mask) is timed alone on one thread, in CPU seconds (`forward_cpu_seconds`: load
stretches wall time, not CPU time, so a loaded machine only makes the runs' ratio smaller than
the one set here). Where a transfer of FRACTION of that compute would be under FLOOR seconds
(any CPU faster than the 2-core Xeon the test was written on), the query heads are raised
first (the compute grows with them, the K/V block does not) and the step timed again: the
exposed time is measured against the transfer, and on a loaded 2-core machine the scheduler
adds some 50 ms of noise, which an 84 ms transfer cannot absorb (4 heads, 203 Mbit/s: exposed
0.54 of the forward's transfer, over the 0.25 limit) and a 0.3 s one can. The rate per rank
is then the one at which a step's K/V block takes FRACTION of the step's compute.
"""
import json
import math
import os
import subprocess
import sys

FRACTION = 0.35   # a step's transfer / a step's compute
FLOOR = 0.3       # seconds: the shortest transfer a step
MAX_HEADS = 256
TOKENS = 4096     # per rank, as the test's --seq-per-rank
KV_BLOCK = 2 * TOKENS * 1 * 64 * 4 + 8 * TOKENS  # K and V (fp32, 1 head of 64) + positions, ids


def step_cpu_seconds(ctxpar, heads):
    cmd = [ctxpar, "attention", "--ranks", "1", "--threads", "1", "--seq", str(TOKENS),
           "--heads", str(heads), "--kv-heads", "1", "--head-dim", "64", "--mask", "none",
           "--repeats", "2", "--json"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                         env=dict(os.environ, OMP_NUM_THREADS="1"))
    if run.returncode != 0:
        sys.exit(f"FAIL: the calibration run failed (exit {run.returncode}): {' '.join(cmd)}\n"
                 f"{run.stderr}")
    return json.loads(run.stdout)["ranks"][0]["forward_cpu_seconds"]


def main():
    ctxpar, heads = sys.argv[1], int(sys.argv[2])
    cpu = step_cpu_seconds(ctxpar, heads)
    if FRACTION * cpu < FLOOR and heads < MAX_HEADS:
        raised = min(MAX_HEADS, math.ceil(heads * FLOOR / (FRACTION * cpu) * 1.1))
        print(f"calibration: {heads} heads compute a step in {cpu:.3f} s CPU, a transfer of "
              f"{FRACTION} of it would be under {FLOOR} s: {raised} heads", file=sys.stderr)
        heads, cpu = raised, step_cpu_seconds(ctxpar, raised)
    rate = max(1, round(KV_BLOCK * 8 / (FRACTION * cpu) / 1e6))
    print(f"calibration: {heads} heads compute a step of forward in {cpu:.3f} s CPU; link shaped "
          f"to {rate} Mbit/s a rank: a step's {KV_BLOCK / 1e6:.2f} MB K/V block takes "
          f"{KV_BLOCK * 8 / (rate * 1e6):.3f} s ({FRACTION} of the compute)", file=sys.stderr)
    print(rate, heads)


if __name__ == "__main__":
    main()
