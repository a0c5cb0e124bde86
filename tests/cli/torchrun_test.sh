#!/usr/bin/env bash
# `ctxpar attention` under a real torchrun (gloo transport, one rank per process; the addresses
# go through the TCPStore that torchrun's agent hosts): the run must pick gloo by itself, pass
# --check, and write outputs bitwise equal to the threads transport's. Then `ctxpar train` and
# `ctxpar decode` the same way. Then an inconsistent launcher environment must be refused naming
# the variable.
#   torchrun_test.sh <torchrun> <ctxpar> <nproc> <work folder>
# Fails (never skips) when torchrun is missing: CI's scripts/setup.sh provides it.
set -uo pipefail
torchrun=$1 ctxpar=$2 n=$3 work=$4
root=$(cd "$(dirname "$0")/../.." && pwd)
for c in "$root/.venv-torch/bin/torchrun" "$root/.venv/bin/torchrun"; do
  [ -n "$torchrun" ] || { [ -x "$c" ] && torchrun=$c; }
done
if [ -z "$torchrun" ] || [ ! -x "$torchrun" ]; then
  echo "FAIL: torchrun not found ('$torchrun'): run scripts/setup.sh (it makes .venv-torch), or" \
       "configure with -DCTXPAR_TORCHRUN=/path/to/torchrun, or set CTXPAR_TORCHRUN" >&2
  exit 1
fi
rm -rf "$work" && mkdir -p "$work/tmp"
export TMPDIR="$work/tmp"  # torchrun's agent leaves its torchelastic_* folders behind: here
args=(attention --seq $((64 * n)) --heads 4 --kv-heads 2 --head-dim 32 --mask causal
      --layout zigzag --strategy ring --backward --timeout 60)
fail() { echo "FAIL: $*" >&2; exit 1; }

# torchrun (gloo) with args + "$@" into $work/$name-gloo, then the threads transport into
# $work/$name-threads: gloo picked by itself, --check passed, every output bitwise equal.
gloo_vs_threads() {
  local name=$1
  shift
  timeout 240 "$torchrun" --no-python --nproc-per-node "$n" --standalone \
    "$ctxpar" "${args[@]}" "$@" --check --json --out "$work/$name-gloo" > "$work/$name.json" \
    2> "$work/$name.err" ||
    { cat "$work/$name.err" >&2; fail "torchrun --nproc-per-node $n ctxpar attention $* exited $?"; }
  grep -q '"transport": "gloo"' "$work/$name.json" || fail "the run did not pick gloo: $(head -c 400 "$work/$name.json")"
  grep -q '"check_passed": true' "$work/$name.json" || fail "$name: --check did not pass"
  grep -q "\"ranks\": $n" "$work/$name.json" || grep -q "\"rank\": $((n - 1))" "$work/$name.json" ||
    fail "the JSON does not report $n ranks"
  "$ctxpar" "${args[@]}" "$@" --ranks "$n" --transport threads --out "$work/$name-threads" > /dev/null ||
    fail "the threads run failed"
  count=0
  for f in "$work/$name-threads"/*.npy; do
    cmp -s "$f" "$work/$name-gloo/$(basename "$f")" || fail "$name: $(basename "$f") differs between gloo and threads"
    count=$((count + 1))
  done
  [ "$count" -ge 5 ] || fail "expected out, lse, dq, dk, dv; found $count files"
}
gloo_vs_threads fp32
echo "PASS: torchrun --nproc-per-node $n: gloo, --check passed, $count outputs bitwise equal to threads"
# The fast bf16 tier travels to every gloo process: the threads transport's answer, bitwise,
# and not the exact tier's (its gradients differ).
gloo_vs_threads fast --dtype bf16 --bf16-tier fast
"$ctxpar" "${args[@]}" --dtype bf16 --ranks "$n" --transport threads --out "$work/exact" > /dev/null ||
  fail "the exact-tier threads run failed"
cmp -s "$work/exact/dv.npy" "$work/fast-gloo/dv.npy" && fail "--bf16-tier fast: dv equals the exact tier's"
echo "PASS: torchrun --nproc-per-node $n: --bf16-tier fast over gloo, $count outputs bitwise equal to threads"

# ctxpar train under torchrun: the same weights as the threads transport, bit for bit.
targs=(train --seq $((32 * n)) --steps 2 --quiet --no-plot)
timeout 240 "$torchrun" --no-python --standalone --nproc-per-node "$n" \
  "$ctxpar" "${targs[@]}" --save "$work/gloo.safetensors" > /dev/null 2> "$work/train.err" ||
  { cat "$work/train.err" >&2; fail "torchrun --nproc-per-node $n ctxpar train exited $?"; }
"$ctxpar" "${targs[@]}" --ranks "$n" --transport threads --save "$work/threads.safetensors" ||
  fail "ctxpar train --transport threads failed"
cmp -s "$work/gloo.safetensors" "$work/threads.safetensors" ||
  fail "train: the weights differ between gloo and threads"
echo "PASS: ctxpar train under torchrun: weights bitwise equal to threads"

# ctxpar decode under torchrun: one rank per process over gloo (it ran P independent copies,
# each a whole job on threads, with exit 0), rank 0 alone printing; every decoded token's out
# and lse bitwise those of the threads transport (their hash, --json's outputs_hash).
dargs=(decode --context $((100 * n)) --tokens 3 --chunk 64 --heads 4 --kv-heads 2 --head-dim 32
       --json)
timeout 240 "$torchrun" --no-python --standalone --nproc-per-node "$n" \
  "$ctxpar" "${dargs[@]}" > "$work/decode.json" 2> "$work/decode.err" ||
  { cat "$work/decode.err" >&2; fail "torchrun --nproc-per-node $n ctxpar decode exited $?"; }
grep -q "\"transport\": \"gloo\", \"ranks\": $n," "$work/decode.json" ||
  fail "decode did not run as $n gloo ranks: $(head -c 400 "$work/decode.json")"
[ "$(grep -c '"command": "decode"' "$work/decode.json")" -eq 1 ] || fail "decode: more than rank 0 printed"
want=$("$ctxpar" "${dargs[@]}" --ranks "$n" --transport threads | grep -o '"outputs_hash": "[0-9a-f]*"') ||
  fail "the threads decode failed"
grep -q "$want" "$work/decode.json" || fail "decode: the outputs differ between gloo and threads"
echo "PASS: ctxpar decode under torchrun: $n gloo ranks, outputs bitwise equal to threads"

# An environment torchrun would never make: refused (exit 2) naming the variable.
err=$(env RANK=2 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29999 "$ctxpar" "${args[@]}" 2>&1)
rc=$?
[ $rc -eq 2 ] || fail "inconsistent RANK/WORLD_SIZE: exit $rc, expected 2: $err"
echo "$err" | grep -q "RANK=2 is not below WORLD_SIZE=2" || fail "message does not name RANK: $err"
err=$(env RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=http "$ctxpar" "${args[@]}" 2>&1)
rc=$?
[ $rc -eq 2 ] || fail "bad MASTER_PORT: exit $rc, expected 2: $err"
echo "$err" | grep -q "MASTER_PORT must be a whole number" || fail "message does not name MASTER_PORT: $err"
echo "PASS: inconsistent launcher environments refused naming the variable"
