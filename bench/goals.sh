#!/usr/bin/env bash
# Measures the timing goals of issues 2 and 3 in one go and prints each as a ratio measured in
# the same run. Run it on a quiet machine (nothing else busy): ~6 minutes on 2 cores.
#   bash bench/goals.sh [build/ctxpar] [out-dir]
set -euo pipefail
CTXPAR=${1:-build/ctxpar}
OUT=${2:-bench-goals}
mkdir -p "$OUT"
export OMP_NUM_THREADS=1
echo "kernel, 1 and 2 threads (T=4096, H=8, D=128, fp32)" >&2
$CTXPAR bench kernel --seq 4096 --heads 8 --head-dim 128 --threads 1 --repeats 3 --json > "$OUT/kernel_1t.json"
$CTXPAR bench kernel --seq 4096 --heads 8 --head-dim 128 --threads 2 --repeats 3 --json > "$OUT/kernel_2t.json"
echo "attention, causal, T=32768, H=8, D=128: P=2 contiguous, P=2 zigzag, P=1 x 2 threads" >&2
common="--seq 32768 --heads 8 --head-dim 128 --mask causal --json"
$CTXPAR attention $common --ranks 2 --layout contiguous > "$OUT/p2_contiguous.json"
$CTXPAR attention $common --ranks 2 --layout zigzag > "$OUT/p2_zigzag.json"
$CTXPAR attention $common --ranks 1 --threads 2 > "$OUT/p1_2threads.json"
/usr/bin/python3 - "$OUT" <<'PY'
import json, sys, os
d = sys.argv[1]
k1 = json.load(open(os.path.join(d, "kernel_1t.json")))
k2 = json.load(open(os.path.join(d, "kernel_2t.json")))
def g(name): return json.load(open(os.path.join(d, name)))
c, z, s = g("p2_contiguous.json"), g("p2_zigzag.json"), g("p1_2threads.json")
print(f"kernel 1 thread : peak {k1['peak_gflops']:.1f} GFLOP/s, fwd {k1['fwd_gflops']:.1f} ({k1['fwd_peak_ratio']:.3f} of peak), "
      f"bwd {k1['bwd_gflops']:.1f} ({k1['bwd_peak_ratio']:.3f}), causal fwd {k1['causal_fwd_gflops']:.1f} "
      f"({k1['causal_fwd_gflops'] / k1['fwd_gflops']:.3f} x non-causal)")
print(f"kernel 2 threads: peak {k2['peak_gflops']:.1f}, fwd {k2['fwd_gflops']:.1f} ({k2['fwd_peak_ratio']:.3f}), "
      f"bwd {k2['bwd_gflops']:.1f} ({k2['bwd_peak_ratio']:.3f}); 2t/1t fwd {k2['fwd_gflops'] / k1['fwd_gflops']:.2f}x, "
      f"bwd {k2['bwd_gflops'] / k1['bwd_gflops']:.2f}x")
print(f"T=32768 causal forward wall: contiguous {c['forward_seconds']:.2f} s, zigzag {z['forward_seconds']:.2f} s, "
      f"one rank x 2 threads {s['forward_seconds']:.2f} s")
print(f"zigzag / contiguous speed-up {c['forward_seconds'] / z['forward_seconds']:.2f}x (goal >= 1.35); "
      f"ring P=2 zigzag vs single rank 2 threads {s['forward_seconds'] / z['forward_seconds']:.2f}x (goal >= 0.9)")
PY
