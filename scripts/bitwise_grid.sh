#!/usr/bin/env bash
# The bitwise grid for a refactor that must not change a bit (docs/architecture.md, "Changing
# the code"): a grid of `ctxpar attention --out` runs (4 strategies x 3 layouts x 4 masks at
# P = 2, 3, 4, forward and backward, plus bf16 in both tiers, GQA, the sim device and odd
# lengths), `ctxpar train --save` checkpoints and `ctxpar decode --json` output hashes; one line
# per run with the sha256 of every file it wrote. Run it with the old and the new binary and
# compare the two lists:
#
#   scripts/bitwise_grid.sh OLD/ctxpar /tmp/old.txt && scripts/bitwise_grid.sh build/ctxpar /tmp/new.txt
#   diff /tmp/old.txt /tmp/new.txt && echo bitwise
#
# About a minute on 2 cores. Sizes are small (T <= 600); every run is --check'ed as well.
set -euo pipefail
ctxpar=$(realpath "$1")
list=$2
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
: > "$list"
export OMP_NUM_THREADS=1
n=0
attention() {  # NAME ARGS...: one --out run, its files hashed
  local name=$1
  shift
  "$ctxpar" attention --seed 7 --check --out "$work/$name" "$@" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; echo "bitwise_grid.sh: run $name failed: ctxpar attention $*" >&2; exit 1; }
  (cd "$work/$name" && sha256sum -- *.npy | awk -v n="$name" '{ printf "%s %s %s\n", n, $2, $1 }') >> "$list"
  n=$((n + 1))
}
masks=("none" "causal" "window:40,8" "causal+documents:100,212,200")
for strategy in ring allgather ulysses hybrid; do
  for layout in contiguous zigzag striped; do
    for m in 0 1 2 3; do
      p=$(( m % 2 == 0 ? 2 : 4 ))
      [ "$strategy" = ulysses ] && [ $m -eq 3 ] && p=2
      attention "$strategy-$layout-m$m-p$p" --seq 512 --heads 4 --head-dim 32 --ranks $p \
        --strategy $strategy --layout $layout --mask "${masks[$m]}" --backward
    done
  done
done
attention ring-p3-odd --seq 601 --heads 3 --head-dim 24 --ranks 3 --mask causal --backward
attention allgather-p3-gqa --seq 480 --heads 6 --kv-heads 2 --head-dim 40 --ranks 3 --strategy allgather --mask causal --backward
attention hybrid-p4-u2 --seq 512 --heads 4 --head-dim 32 --ranks 4 --strategy hybrid --ulysses-degree 2 --mask causal --backward
attention ring-bf16-exact --seq 512 --heads 4 --head-dim 64 --ranks 2 --dtype bf16 --mask causal --backward
attention ring-bf16-fast --seq 512 --heads 4 --head-dim 64 --ranks 2 --dtype bf16 --bf16-tier fast --mask causal --backward
attention ulysses-bf16-gqa --seq 512 --heads 4 --kv-heads 2 --head-dim 64 --ranks 2 --strategy ulysses --dtype bf16 --backward
attention ring-sim --seq 512 --heads 4 --head-dim 32 --ranks 4 --device sim --mask causal --backward
attention allgather-sim --seq 512 --heads 4 --head-dim 32 --ranks 2 --strategy allgather --device sim --mask "window:40,8" --backward
attention ring-batch2 --seq 256 --batch 2 --heads 2 --head-dim 16 --ranks 2 --mask causal --backward
attention ring-p1 --seq 300 --heads 2 --head-dim 32 --ranks 1 --mask causal --backward
for t in "ring 4 1" "ulysses 2 2" "hybrid 4 1"; do
  read -r strategy ranks dp <<< "$t"
  name="train-$strategy-r$ranks-dp$dp"
  "$ctxpar" train --seq 256 --steps 3 --layers 1 --dim 64 --heads 4 --kv-heads 2 --head-dim 16 \
    --hidden 64 --ranks "$ranks" --dp "$dp" --strategy "$strategy" --quiet --no-plot \
    --save "$work/$name.safetensors" > "$work/$name.log" 2>&1 ||
    { cat "$work/$name.log" >&2; echo "bitwise_grid.sh: $name failed" >&2; exit 1; }
  echo "$name checkpoint $(sha256sum < "$work/$name.safetensors" | cut -d' ' -f1)" >> "$list"
  n=$((n + 1))
done
for t in "2 fp32" "3 bf16"; do
  read -r ranks dtype <<< "$t"
  name="decode-r$ranks-$dtype"
  "$ctxpar" decode --context 700 --tokens 4 --ranks "$ranks" --heads 4 --kv-heads 2 --head-dim 32 \
    --dtype "$dtype" --block 64 --json > "$work/$name.json" 2> "$work/$name.log" ||
    { cat "$work/$name.log" >&2; echo "bitwise_grid.sh: $name failed" >&2; exit 1; }
  hash=$(python3 -c "import json,sys; print(json.load(open(sys.argv[1])).get('outputs_hash', 'none'))" "$work/$name.json")
  echo "$name outputs_hash $hash" >> "$list"
  n=$((n + 1))
done
echo "bitwise_grid.sh: $n runs, $(wc -l < "$list") hashes in $list"
