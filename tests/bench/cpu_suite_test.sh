#!/usr/bin/env bash
# bench/cpu_suite.sh at --quick shapes, one repetition, no torch (then a stand-in torch): every
# run it makes succeeds, the report prints every ratio with a number, the ggml rows appear when
# --ggml names a binary (here a stand-in that prints ggml_fa's JSON with a fixed time: this tests
# the suite's plumbing, not ggml), and usage errors exit 2 naming the option.
# Usage: cpu_suite_test.sh SOURCE_DIR BUILD_DIR
set -uo pipefail
SRC=$1 BUILD=$2
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
fail() { echo "FAIL: $*"; exit 1; }

cat > "$TMP/fake_ggml" <<'FAKE'
#!/usr/bin/env bash
# Stands in for bench/ggml_fa.cc's binary: checks the arguments the suite passes, prints its JSON.
[[ " $* " == *" --seq "* && " $* " == *" --threads "* ]] || { echo "bad arguments: $*" >&2; exit 2; }
echo '{"impl": "ggml_flash_attn_ext", "ggml_version": "stand-in", "ggml_commit": "none", "fwd_seconds": 0.5, "fwd_gflops": 1.0}'
FAKE
chmod +x "$TMP/fake_ggml"

bash "$SRC/bench/cpu_suite.sh" --build "$BUILD" --quick --repeats 1 --no-torch --ggml "$TMP/fake_ggml" \
  --out "$TMP/q" > "$TMP/out.txt" 2> "$TMP/err.txt" || { cat "$TMP/out.txt" "$TMP/err.txt"; fail "the suite failed"; }
cat "$TMP/out.txt"
for row in "ctxpar forward / one-thread FMA peak" "ring P=2 zigzag causal / one rank with 2 threads" \
           "zigzag / contiguous" "ggml flash attention speed, forward, 2 threads, ggml's K/V fp32"; do
  line=$(grep -F "$row" "$TMP/out.txt") || fail "no row '$row'"
  [[ $line =~ [0-9]+\.[0-9]{3} ]] || fail "row '$row' has no figure: $line"
done
# The zigzag / contiguous row has its ratio by per-rank CPU time too (wall, CPU).
line=$(grep -F "zigzag / contiguous" "$TMP/out.txt")
[[ $line =~ [0-9]+\.[0-9]{3}.*[0-9]+\.[0-9]{3}.*[0-9]+\.[0-9]{3}.*[0-9]+\.[0-9]{3}.*[0-9]+\.[0-9]{3} ]] ||
  fail "row 'zigzag / contiguous' has no CPU ratio beside the wall one: $line"
# On an AVX512_BF16 CPU both tiers through vdpbf16ps beside fp32 products forced.
if grep -qw avx512_bf16 /proc/cpuinfo; then
  for row in "vdpbf16ps bf16 products / fp32 products speed" "vdpbf16ps, fast bf16 tier / fp32 products speed"; do
    line=$(grep -F "$row" "$TMP/out.txt" | head -n1) || fail "no row '$row'"
    [[ $line =~ [0-9]+\.[0-9]{3} ]] || fail "row '$row' has no figure: $line"
  done
fi
# The CPU named by family and model too (the kinds this project meets share a model name).
fam=$(LC_ALL=C lscpu | sed -n 's/^CPU family: *//p') mod=$(LC_ALL=C lscpu | sed -n 's/^Model: *//p')
grep -qF "(family $fam model $mod)" "$TMP/out.txt" || fail "the machine line does not say family $fam model $mod"
grep -q "torch: SKIPPED: --no-torch given" "$TMP/out.txt" || fail "torch was not reported as skipped"
python3 - "$TMP/q/summary.json" <<'PY' || fail "summary.json"
import json, sys
s = json.load(open(sys.argv[1]))
assert s["failed_runs"] == [], s["failed_runs"]
c = s["figures"]["zigzag_vs_contiguous"]["cpu"]
assert c["repetitions"] == 1 and c["median"] > 0, c
f = s["figures"]["vs_ggml_2t"]
k = s["medians_of_absolute_figures"]["kernel_2t"]["fwd_seconds"]
assert abs(f["median"] - 0.5 / k) < 1e-9 * f["median"], (f, k)  # the stand-in's 0.5 s / ctxpar's
PY

# With torch: a stand-in interpreter for bench/torch_sdpa.py (its --info, then its JSON with fixed
# times; this tests the suite's plumbing, not torch): each torch run is bracketed by the FMA peak
# (`ctxpar bench kernel --peak-only`), and the report gives every ratio against each side's own
# peak and what fp32's 1.2 x torch needs of the peak.
cat > "$TMP/fake_python" <<'FAKE'
#!/usr/bin/env bash
# Stands in for `PY -c 'import torch'` and `PY bench/torch_sdpa.py ...`: --info, or a run's JSON
# (1 s a pass; 2 s on --memory bthd, torch_bthd_*'s storage).
[ "$1" = -c ] && exit 0
[[ " $* " == *" --info "* ]] && { echo '{"torch_version": "2.15.0", "cpu_capability": "AVX512", "python": "3.11"}'; exit 0; }
[[ " $* " == *" --threads "* && " $* " == *" --dtype "* ]] || { echo "bad arguments: $*" >&2; exit 2; }
[[ " $* " == *" --memory bthd "* ]] && s=2.0 || s=1.0
echo "{\"fwd_seconds\": $s, \"bwd_seconds\": $s, \"causal_fwd_seconds\": $s, \"causal_bwd_seconds\": $s, \"fwd_gflops\": 2.0, \"bwd_gflops\": 5.0, \"causal_fwd_gflops\": 1.0, \"causal_bwd_gflops\": 2.5}"
FAKE
chmod +x "$TMP/fake_python"
bash "$SRC/bench/cpu_suite.sh" --build "$BUILD" --quick --repeats 1 --torch-python "$TMP/fake_python" \
  --out "$TMP/t" > "$TMP/out_t.txt" 2> "$TMP/err_t.txt" || { cat "$TMP/out_t.txt" "$TMP/err_t.txt"; fail "the suite with a stand-in torch failed"; }
for row in "ctxpar / torch SDPA, each / its FMA peak, forward, non-causal, 1 thread" \
           "torch SDPA fp32 backward, causal / two-thread FMA peak" "ctxpar forward, causal / one-thread FMA peak"; do
  line=$(grep -F "$row" "$TMP/out_t.txt") || fail "no row '$row'"
  [[ $line =~ [0-9]+\.[0-9]{3} ]] || fail "row '$row' has no figure: $line"
done
grep -qE "^  1 thread: forward [0-9.]+ \([0-9.]+\)" "$TMP/out_t.txt" || fail "no fp32 needs line for 1 thread"
python3 - "$TMP/t" <<'PY' || fail "the torch runs' peaks"
import json, os, sys
for name in ("torch_1t", "torch_2t", "torch_bf16_1t", "torch_bf16_2t", "torch_bthd_1t",
             "torch_bthd_2t", "torch_bthd_bf16_1t"):
    r = json.load(open(os.path.join(sys.argv[1], "raw", "rep1", name + ".json")))
    assert r["peak_gflops_before"] > 0 and r["peak_gflops_after"] > 0, (name, r)
    # torch_sdpa.py's own JSON kept; --memory bthd passed to the bthd runs alone
    assert r["fwd_seconds"] == (2.0 if "bthd" in name else 1.0), (name, r)
s = json.load(open(os.path.join(sys.argv[1], "summary.json")))
f = s["figures"]["vs_torch_at_peak_fwd_1t"]
assert f["repetitions"] == 1 and f["median"] > 0, f
k = s["medians_of_absolute_figures"]["kernel_1t"]["fwd_seconds"]
f = s["figures"]["vs_torch_bthd_fwd_1t"]
assert abs(f["median"] - 2.0 / k) < 1e-9 * f["median"], (f, k)
PY

expect_usage() {  # expect_usage TEXT ARGS...: exit 2 and TEXT in the message
  local text=$1; shift
  bash "$SRC/bench/cpu_suite.sh" --build "$BUILD" "$@" > "$TMP/u.txt" 2>&1
  local rc=$?
  [ "$rc" = 2 ] || { cat "$TMP/u.txt"; fail "$* exited $rc, expected 2"; }
  grep -qF -- "$text" "$TMP/u.txt" || { cat "$TMP/u.txt"; fail "$* did not say '$text'"; }
}
expect_usage "--ggml $TMP/none is not an executable file" --no-torch --ggml "$TMP/none" --out "$TMP/u1"
printf '#!/bin/sh\nexit 1\n' > "$TMP/broken" && chmod +x "$TMP/broken"
expect_usage "failed a 64-token trial run" --no-torch --ggml "$TMP/broken" --out "$TMP/u2"
expect_usage "--repeats must be a whole number" --repeats 0
echo "PASS"
