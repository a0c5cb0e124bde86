#!/bin/bash
# ctxpar decode end to end: sizes parse (1M), runs report JSON in both prefill modes, usage
# errors exit 2 naming the option, and under mpirun one rank per process.
# usage: cli_test.sh CTXPAR [MPIEXEC]
set -u
ctxpar=$1 mpiexec=${2:-}
fails=0
# expect CODE REGEX -- ARGS...: the exit status is CODE and the output matches REGEX.
expect() {
  local code=$1 regex=$2
  shift 3
  local out rc
  out=$(timeout 120 "$@" 2>&1); rc=$?
  if [[ $rc -ne $code ]] || ! grep -Eq -- "$regex" <<<"$out"; then
    echo "FAIL: $* -> exit $rc (want $code), output:"; echo "$out"; echo "(wanted /$regex/)"
    fails=$((fails + 1))
  fi
}
# 1M tokens parse; (2^20 + 1) / 8 ranks = 131073 tokens on rank 0 = 2049 blocks of 64 x 520 B.
expect 2 'needs 65.0 MiB on a rank, over --max-cache-bytes' -- \
  "$ctxpar" decode --context 1M --ranks 8 --tokens 1 --max-cache-bytes 1000
# 600 tokens against no cache (pass-KV moves fewer bytes), then 100 against 600 (pass-Q).
expect 0 '"decoded_tokens": 3.*"prefill": "pass-kv\+pass-q"' -- \
  "$ctxpar" decode --context 700 --ranks 3 --tokens 3 --chunk 600 --heads 4 --kv-heads 2 --json
expect 0 '"prefill": "pass-kv"' -- \
  "$ctxpar" decode --lengths 300,170 --ranks 2 --tokens 2 --prefill-mode pass-kv --json
expect 0 '"prefill": "fill"' -- "$ctxpar" decode --context 2K --ranks 4 --tokens 2 --prefill fill --json
expect 2 '--mask none lets a token see every later one, which a KV cache cannot give' -- \
  "$ctxpar" decode --mask none
expect 2 '--prefill-mode: unknown prefill mode .pass-x.' -- "$ctxpar" decode --prefill-mode pass-x
expect 2 '--kv-heads 3 must divide --heads 8' -- "$ctxpar" decode --kv-heads 3
expect 2 '--context must be in \[1, ' -- "$ctxpar" decode --context 0
# Round five: --bf16-tier (KvCacheOptions::kernel, prefill's and decode's kernel calls) runs and
# is reported; the default is exact; a bad value exits 2 naming the option and both choices.
expect 0 '"dtype": "bf16", "bf16_tier": "fast", .*"prefill": "pass-kv\+pass-q"' -- \
  "$ctxpar" decode --context 700 --ranks 3 --tokens 3 --chunk 600 --heads 4 --kv-heads 2 \
  --dtype bf16 --bf16-tier fast --json
expect 0 '"dtype": "bf16", "bf16_tier": "exact"' -- "$ctxpar" decode --context 300 --tokens 2 \
  --dtype bf16 --json
expect 0 'D 64, bf16 \(fast tier\), block 64' -- "$ctxpar" decode --context 300 --tokens 2 \
  --dtype bf16 --bf16-tier fast
expect 2 '--bf16-tier bogus: expected exact or fast' -- "$ctxpar" decode --dtype bf16 --bf16-tier bogus
expect 0 'with fp32 inputs the tier changes nothing' -- "$ctxpar" decode --help
# ctxpar bench decode: a tiny run reports both kernels against the read bandwidth; bad use exits 2.
expect 0 '"in_place_of_stream":.*"in_place_over_tiles":.*"dtype":"bf16"' -- \
  "$ctxpar" bench decode --context 1K --dtype fp32,bf16 --repeats 1 --stream-mib 1 --json
expect 2 '--dtype: a cache is fp32 or bf16, got .i32.' -- "$ctxpar" bench decode --dtype i32
expect 2 '--heads 8 must be a multiple of --kv-heads 3' -- "$ctxpar" bench decode --kv-heads 3
expect 2 'or lower --context' -- "$ctxpar" bench decode --context 100M
expect 2 '--context: each must be 1\.\.' -- "$ctxpar" bench decode --context 0
# --mask: a documents cache (the decoded token continues the last document: it sees 125 keys,
# 900..1024, of 2 KiB each); a documents mask without lengths, or lengths past the context,
# exits 2 naming --mask.
expect 0 '"mask":"causal\+documents".*"cache_bytes_per_token":256000\.0,' -- \
  "$ctxpar" bench decode --context 1K --mask causal+documents:900,24 --dtype fp32 --repeats 1 \
  --stream-mib 1 --json
expect 2 '--mask: documents need their lengths, summing to at most the smallest --context \(0 given\)' -- \
  "$ctxpar" bench decode --mask causal+documents
expect 2 '--mask: documents need their lengths, .*\(2000 given\)' -- \
  "$ctxpar" bench decode --context 1K --mask causal+documents:1000,1000
# --plan runs nothing and predicts (the 8 KiB per token and the exact prefill bytes are the
# planner's arithmetic, which tests/inference/plan_test.cc checks against the counters).
expect 0 '"decode_bytes_per_token": 8256, .*"pass_kv_bytes": 135266304, "pass_q_bytes": 33718272, "pass_kv_seconds": [0-9.e+-]*, "pass_q_seconds": [0-9.e+-]*, "auto": "pass-q", "crossover_bytes": 28577' -- \
  "$ctxpar" decode --plan --context 128K --chunk 4096 --ranks 2 --heads 8 --kv-heads 1 --head-dim 128 --json
expect 0 'crossover for 4096 new tokens: pass-q moves fewer bytes from 28577 cached tokens' -- \
  "$ctxpar" decode --plan --context 1M --chunk 4096 --ranks 2 --heads 8 --kv-heads 1 --head-dim 128
# The context from .npy files: [C, Hkv, D] float32 (C = 300, Hkv = 1, D = 16), written here.
npy=$(mktemp -d)
trap 'rm -rf "$npy"' EXIT
header="{'descr': '<f4', 'fortran_order': False, 'shape': (300, 1, 16), }"
while (( (10 + ${#header} + 1) % 64 )); do header+=" "; done
{ printf '\x93NUMPY\x01\x00'; printf "\\x$(printf %02x $(( (${#header} + 1) % 256 )))\\x$(printf %02x $(( (${#header} + 1) / 256 )))";
  printf '%s\n' "$header"; head -c $((300 * 16 * 4)) /dev/zero | tr '\000' '\074'; } > "$npy/k.npy"
cp "$npy/k.npy" "$npy/v.npy"
expect 0 '"context_tokens": 300' -- "$ctxpar" decode --context 300 --heads 2 --kv-heads 1 \
  --head-dim 16 --ranks 3 --tokens 2 --k-npy "$npy/k.npy" --v-npy "$npy/v.npy" --json
expect 2 '--k-npy .*expected shape \[C, 1, 16\] .* with C >= 400' -- "$ctxpar" decode --context 400 \
  --heads 2 --kv-heads 1 --head-dim 16 --k-npy "$npy/k.npy" --v-npy "$npy/v.npy"
# The library's one rule for a cache's mask (check_cache_mask): a right window bound was taken
# under causal, which KVCache and the library took in any form (docs/faults.md, "Round six:
# the KV cache and decode").
expect 2 '--mask causal\+window:4,2 names later tokens .* use causal or causal\+window:L,0' -- \
  "$ctxpar" decode --mask causal+window:4,2
expect 2 '--batch must be in \[1, 1048576\]' -- "$ctxpar" decode --batch 1048577
# The memory check counts the prefill's rows, not only the cache: --heads 4096 over 32K tokens
# passed and failed allocating 16 GiB of queries; refused at once (a limit of 16 GB makes the
# verdict the same on any machine). --block 4M: the context was drawn a whole block at a time
# (58 s for 100 tokens); now row by row, it runs at once (or, short of memory for the cache's
# 2 GiB block, is refused at once).
# within SECONDS CODES REGEX -- ARGS...: exits with one of CODES ("0|2") within SECONDS,
# its output matching REGEX.
within() {
  local seconds=$1 codes=$2 regex=$3
  shift 4
  local out rc start=$SECONDS
  out=$(timeout 120 "$@" 2>&1); rc=$?
  if ! [[ $rc =~ ^($codes)$ ]] || ! grep -Eq -- "$regex" <<<"$out" || (( SECONDS - start > seconds )); then
    echo "FAIL: $* -> exit $rc (want $codes) after $((SECONDS - start)) s (at most $seconds), output:"
    echo "$out"; echo "(wanted /$regex/)"
    fails=$((fails + 1))
  fi
}
within 2 2 'the run needs .*GiB.*prefill call.*--heads 4096.*smaller --chunk' -- \
  env CTXPAR_MEMORY_LIMIT_BYTES=16000000000 "$ctxpar" decode --heads 4096 --context 32768 --tokens 1
within 10 '0|2' '"context_tokens": 100|the run needs .* KV cache' -- \
  "$ctxpar" decode --block 4194304 --context 100 --tokens 2 --json
# Launchers: srun without MPI is refused as `attention` refuses it; torchrun's copies join over
# gloo (tests/cli/torchrun_test.sh), and an incomplete torchrun environment is named.
expect 2 'started by srun \(SLURM_STEP_NUM_TASKS=2\) .* mpirun -n 2 ctxpar decode' -- \
  env SLURM_PROCID=0 SLURM_STEP_NUM_TASKS=2 "$ctxpar" decode --context 100 --tokens 1
expect 2 'MASTER_ADDR is not set' -- \
  env WORLD_SIZE=2 RANK=0 LOCAL_RANK=0 "$ctxpar" decode --context 100 --tokens 1
# The merges across ranks (KvCacheOptions::merge): chain gives allgather's bits (rank order), the
# tree other bits; auto takes one of the two with allgather's bits, timed; a bad one exits 2.
ag=$("$ctxpar" decode --context 500 --tokens 2 --ranks 5 --merge allgather --json | grep -o '"outputs_hash": "[0-9a-f]*"')
expect 0 "\"merge\": \"chain\".*$ag" -- "$ctxpar" decode --context 500 --tokens 2 --ranks 5 --merge chain --json
expect 0 "\"merge\": \"(allgather|chain)\", \"merge_seconds_measured\": \{\"allgather\": [0-9]\.[0-9e-]+, .*$ag" -- \
  "$ctxpar" decode --context 500 --tokens 2 --ranks 5 --json
expect 0 '"merge": "tree"' -- "$ctxpar" decode --context 500 --tokens 2 --ranks 5 --merge tree --json
expect 2 '--merge: unknown decode merge .ring.; valid: allgather, chain, tree \(or auto\)' -- \
  "$ctxpar" decode --merge ring
expect 0 'merge of the partials, timed on 3 threads here: allgather [0-9.]+ us, chain [0-9.]+ us, tree [0-9.]+ us' -- \
  "$ctxpar" decode --plan --context 500 --ranks 3
if [[ -n $mpiexec ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
  expect 0 '"transport": "mpi", "ranks": 2' -- "$mpiexec" -n 2 --oversubscribe \
    --mca btl_vader_single_copy_mechanism none "$ctxpar" decode --context 500 --tokens 2 --json
  # The same answer as the threads transport, bitwise (the hash of every decoded out and lse).
  hash=$("$ctxpar" decode --context 500 --tokens 2 --ranks 2 --json | grep -o '"outputs_hash": "[0-9a-f]*"')
  expect 0 "\"transport\": \"mpi\".*$hash" -- "$mpiexec" -n 2 --oversubscribe \
    --mca btl_vader_single_copy_mechanism none "$ctxpar" decode --context 500 --tokens 2 --json
  # The tree over MPI, 3 ranks (one folds in): the threads' bits.
  tree=$("$ctxpar" decode --context 500 --tokens 2 --ranks 3 --merge tree --json | grep -o '"outputs_hash": "[0-9a-f]*"')
  expect 0 "\"transport\": \"mpi\".*\"merge\": \"tree\".*$tree" -- "$mpiexec" -n 3 --oversubscribe \
    --mca btl_vader_single_copy_mechanism none "$ctxpar" decode --context 500 --tokens 2 --merge tree --json
  expect 0 '"transport": "mpi", .*"bf16_tier": "fast"' -- "$mpiexec" -n 2 --oversubscribe \
    --mca btl_vader_single_copy_mechanism none "$ctxpar" decode --context 500 --tokens 2 \
    --dtype bf16 --bf16-tier fast --json
  # An MPMD line whose ranks got different options is refused before anything runs, naming
  # the option (the check used to drop its verdict: --seed 1 / 2 ran with exit 0).
  for pair in "--bf16-tier fast|--bf16-tier exact" "--seed 1|--seed 2"; do
    a=${pair%|*} b=${pair#*|}
    # shellcheck disable=SC2086
    expect 2 "decode: the ranks were started with different options: ${a% *} is ${a#* } on rank 0 but ${b#* } on rank 1" -- \
      "$mpiexec" --oversubscribe --mca btl_vader_single_copy_mechanism none \
      -n 1 "$ctxpar" decode --context 500 --tokens 2 --dtype bf16 $a : \
      -n 1 "$ctxpar" decode --context 500 --tokens 2 --dtype bf16 $b
  done
  # --plan on one rank only: agreed first, as every option (it returned on its own while the
  # other rank waited 120 s in the agreement, naming nothing).
  expect 2 'decode: the ranks were started with different options: --plan is on on rank 0 but off on rank 1' -- \
    "$mpiexec" --oversubscribe --mca btl_vader_single_copy_mechanism none \
    -n 1 "$ctxpar" decode --context 500 --tokens 2 --plan : -n 1 "$ctxpar" decode --context 500 --tokens 2
fi
exit $((fails > 0))
