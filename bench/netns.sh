# Shell helpers (sourced, bash) for MPI runs over a shaped TCP link: a private network
# namespace whose loopback is shaped with `tc tbf`. Used by bench/net_overlap.sh and the `net`
# tests (tests/mpi/net_*_test.sh). Only loopback addresses inside the namespace are used.
#
#   . bench/netns.sh
#   netns_create            # makes ctxpar-net-<pid>, deletes it on exit; exit 77 ("SKIP: why")
#                           # where namespaces, tc or mpirun are not available
#   netns_shape 100         # shape lo to 100 Mbit/s (every rank's traffic shares it)
#   netns_mpirun 2 CMD...   # mpirun -n 2 over TCP on that lo (env passes through)

netns_skip() { echo "SKIP: $*"; exit 77; }

netns_create() {
  command -v ip >/dev/null || netns_skip "iproute2's ip is not installed (apt-get install iproute2)"
  command -v tc >/dev/null || netns_skip "tc is not installed (apt-get install iproute2)"
  command -v mpirun >/dev/null || netns_skip "mpirun is not on PATH"
  # Namespaces of runs that were killed before their trap ran (their pid is gone).
  local ns pid
  for ns in $(ip netns list 2>/dev/null | awk '{print $1}' | grep '^ctxpar-net-' || true); do
    pid=${ns#ctxpar-net-}
    kill -0 "$pid" 2>/dev/null || ip netns del "$ns" 2>/dev/null || true
  done
  NETNS=ctxpar-net-$$
  ip netns add "$NETNS" 2>/dev/null ||
    netns_skip "cannot create a network namespace (ip netns add needs root or CAP_NET_ADMIN)"
  trap 'ip netns del "$NETNS" 2>/dev/null || true' EXIT
  trap 'exit 130' INT TERM
  ip netns exec "$NETNS" ip link set lo up || netns_skip "cannot bring up lo inside the namespace"
  # burst >= lo's 64 KiB MTU (a larger packet would be dropped); latency 2 s: a deep queue, so
  # nothing is dropped and TCP sees a clean bottleneck.
  ip netns exec "$NETNS" tc qdisc add dev lo root tbf rate 1mbit burst 256kb latency 2s \
    2>/dev/null || netns_skip "tc tbf is not available here (kernel without sch_tbf, or no permission)"
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMP_NUM_THREADS=1
}

netns_shape() {
  ip netns exec "$NETNS" tc qdisc change dev lo root tbf rate "$1mbit" burst 256kb latency 2s
}

# NETNS_TIMEOUT (default 300) bounds each run in seconds.
netns_mpirun() {
  local n=$1
  shift
  local rc=0
  timeout -k 5 "${NETNS_TIMEOUT:-300}" ip netns exec "$NETNS" \
    mpirun -n "$n" --oversubscribe --bind-to none \
      --mca btl tcp,self --mca btl_tcp_if_include lo --mca oob_tcp_if_include lo "$@" || rc=$?
  # timeout's own codes: say which bound ended the run (a killed run printed nothing at all).
  if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
    echo "netns_mpirun: $n ranks did not end within NETNS_TIMEOUT = ${NETNS_TIMEOUT:-300} s and were" \
         "killed (exit $rc); a loaded machine slows the shaped runs: rerun on a quieter one or" \
         "raise the bound (--run-timeout)" >&2
  fi
  return $rc
}
