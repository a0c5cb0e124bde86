#!/usr/bin/env bash
# Two hosts for real: two network namespaces joined by a veth pair (10.77.x.1 and 10.77.x.2),
# one rank in each, over MPI (mpirun starts the second rank's daemon in the other namespace
# through a plm_rsh_agent that is `ip netns exec`) and over gloo (RANK / WORLD_SIZE /
# MASTER_ADDR / MASTER_PORT set by hand, no torchrun agent: rank 0 hosts the TCP store). Both
# must pass --check, send their bytes over the veth, and write outputs bitwise equal to the
# threads transport's.
#   netns_two_hosts_test.sh <ctxpar> <work folder>
# Skips (exit 77) only where network namespaces cannot be created (not root).
set -uo pipefail
ctxpar=$1 work=$2
fail() { echo "FAIL: $*" >&2; exit 1; }
command -v ip >/dev/null || { echo "SKIP: iproute2's ip is not installed"; exit 77; }
id=$$
A=ctxpar-hostA-$id B=ctxpar-hostB-$id vA=ctxA$((id % 100000)) vB=ctxB$((id % 100000))
ip netns add "$A" 2>/dev/null ||
  { echo "SKIP: cannot create a network namespace (ip netns add needs root or CAP_NET_ADMIN)"; exit 77; }
trap 'ip netns del "$A" 2>/dev/null; ip netns del "$B" 2>/dev/null; rm -f "$work/rsh"' EXIT
ip netns add "$B" || fail "ip netns add $B"
net=10.77.$((id % 250))
ip link add "$vA" type veth peer name "$vB" || fail "cannot create a veth pair"
ip link set "$vA" netns "$A" && ip link set "$vB" netns "$B" || fail "cannot move the veth ends"
ip -n "$A" addr add "$net.1/24" dev "$vA" && ip -n "$B" addr add "$net.2/24" dev "$vB" || fail "addresses"
for ns in "$A" "$B"; do ip -n "$ns" link set lo up; done
ip -n "$A" link set "$vA" up && ip -n "$B" link set "$vB" up || fail "cannot bring the veth up"
rm -rf "$work" && mkdir -p "$work"
export OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
args=(attention --seq 2048 --heads 4 --head-dim 32 --mask causal --layout zigzag --strategy ring
      --backward --timeout 60)
tx_bytes() { ip netns exec "$A" cat "/sys/class/net/$vA/statistics/tx_bytes"; }
# K and V of one rank's 1024 tokens (4 heads x 32, fp32) cross the link at least once.
min_bytes=$((1024 * 4 * 32 * 4 * 2))

"$ctxpar" "${args[@]}" --ranks 2 --transport threads --out "$work/threads" > /dev/null ||
  fail "the threads run failed"
same_as_threads() {
  local n=0 f
  for f in "$work"/threads/*.npy; do
    cmp -s "$f" "$work/$1/$(basename "$f")" || fail "$1: $(basename "$f") differs from threads"
    n=$((n + 1))
  done
  [ $n -ge 5 ] || fail "$1: expected 5 outputs, found $n"
}

# gloo: one process per namespace (the same options: the ranks check that they agree), the
# store on rank 0's address; rank 0 writes the outputs.
port=$((29400 + id % 500))
before=$(tx_bytes)
for r in 0 1; do
  ns=$A; [ $r -eq 1 ] && ns=$B
  timeout 120 ip netns exec "$ns" env RANK=$r WORLD_SIZE=2 MASTER_ADDR=$net.1 MASTER_PORT=$port \
    "$ctxpar" "${args[@]}" --check --json --out "$work/gloo" > "$work/gloo.$r.out" 2> "$work/gloo.$r.err" &
  pids[$r]=$!
done
for r in 0 1; do
  wait "${pids[$r]}" || { rc=$?; cat "$work/gloo.$r.err" >&2; fail "gloo rank $r exited $rc"; }
done
sent=$(( $(tx_bytes) - before ))
grep -q '"transport": "gloo"' "$work/gloo.0.out" || fail "rank 0 did not run on gloo"
grep -q '"check_passed": true' "$work/gloo.0.out" || fail "gloo: --check did not pass"
[ $sent -ge $min_bytes ] || fail "gloo: only $sent bytes left host A over the veth"
same_as_threads gloo
echo "PASS: gloo across two namespaces: --check passed, $sent bytes over the veth, bitwise equal to threads"

if ! "$ctxpar" --version | grep -q "mpi (mpirun)"; then
  echo "PASS: (MPI half not run: this ctxpar was built without MPI)"
  exit 0
fi
command -v mpirun > /dev/null || fail "mpirun is not on PATH (openmpi-bin)"
# mpirun runs in A; the rank of host B starts through this agent, in B.
cat > "$work/rsh" <<EOS
#!/bin/sh
host=\$1; shift
case \$host in $net.1) ns=$A ;; *) ns=$B ;; esac
exec ip netns exec \$ns sh -c "\$*"
EOS
chmod +x "$work/rsh"
before=$(tx_bytes)
timeout 120 ip netns exec "$A" mpirun -n 2 --host "$net.1:1,$net.2:1" --bind-to none \
  --mca plm_rsh_agent "$work/rsh" --mca btl tcp,self --mca btl_tcp_if_include "$net.0/24" \
  --mca oob_tcp_if_include "$net.0/24" "$ctxpar" "${args[@]}" --check --json --out "$work/mpi" \
  > "$work/mpi.out" 2> "$work/mpi.err" || { cat "$work/mpi.err" >&2; fail "mpirun across the namespaces exited $?"; }
sent=$(( $(tx_bytes) - before ))
grep -q '"transport": "mpi"' "$work/mpi.out" || fail "the mpirun job did not run on MPI"
grep -q '"check_passed": true' "$work/mpi.out" || fail "MPI: --check did not pass"
[ $sent -ge $min_bytes ] || fail "MPI: only $sent bytes left host A over the veth"
same_as_threads mpi
echo "PASS: MPI across two namespaces: --check passed, $sent bytes over the veth, bitwise equal to threads (and to gloo)"
