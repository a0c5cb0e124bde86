// The `local` hardware preset: this machine, measured on the spot. The kernel's throughput is
// timed on one ring step's block pair by min(P, cores) threads at once (one per rank, as
// `ctxpar attention` runs them, sharing the cores; beyond the cores the rate is scaled by
// cores/P), and the threads transport's simulated link is timed with a real message. Under
// mpirun (LocalOptions::comm) each process times its own rank's kernel, all at once, and the
// MPI link is timed as the ring uses it. See docs/plan.md, "Checked against ourselves".
#include <algorithm>
#include <atomic>
#include <chrono>
#include <functional>
#include <numeric>
#include <thread>

#include <unistd.h>

#include "ctxpar/clock.h"
#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/layout.h"
#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

// Best of `repeats` timings of fn(), each repeated until it has run for at least `min_seconds`.
template <typename Fn>
double seconds_per_call(Fn&& fn, int repeats, double min_seconds) {
  fn();  // warm caches and pages
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    int calls = 0;
    const double t0 = now_seconds();
    double t = 0;
    do {
      fn();
      ++calls;
      t = now_seconds() - t0;
    } while (t < min_seconds);
    best = std::min(best, t / calls);
  }
  return best;
}

}  // namespace

namespace {

// FLOP/s of one rank's kernel thread while `ranks` such threads run at once, as the ranks of
// `ctxpar attention` do: this measures the cores they share, and whatever else this machine
// is running at the time, in one number.
struct KernelRates {
  double forward = 0, backward = 0;
};

// `start_together` returns when every timing rank is ready (threads or processes).
KernelRates rates_of_one_rank(const LocalOptions& o, int rank,
                              const std::function<void()>& start_together) {
  // Rank `rank`'s queries against its own block (the diagonal, with partially masked tiles)
  // and against its predecessor's (the ring's next step), as the layout and mask place them:
  // masked-tile skipping and partial tiles cost what they cost in the real ring. Large
  // problems are measured on a scaled-down sequence of 4096 tokens a rank and about 4 query
  // heads, but always whole query-head groups: the kernel reuses a K/V tile for every query
  // head of its group, so the group size sets its speed (timing a 9-on-1 problem as 4-on-1
  // mispredicted it: docs/benchmarks-history.md, "Plan: earlier runs").
  const int P = o.ranks;
  const int64_t n = std::min<int64_t>(o.block_tokens, 4096);
  const int64_t b = o.batch, d = o.head_dim;
  const int64_t group = std::max<int64_t>(1, o.heads / std::max<int64_t>(1, o.kv_heads));
  const int64_t hkv = std::clamp<int64_t>(4 / group, 1, std::max<int64_t>(1, o.kv_heads));
  const int64_t hq = hkv * group;
  Tensor q(o.dtype, {b, n, hq, d}), k(o.dtype, {b, n, hkv, d}), v(o.dtype, {b, n, hkv, d});
  Tensor dout(o.dtype, {b, n, hq, d});
  Tensor lse(DType::f32, {b, hq, n}), delta(DType::f32, {b, hq, n});
  Tensor dq(DType::f32, {b, n, hq, d}), dk(DType::f32, {b, n, hkv, d}),
      dv(DType::f32, {b, n, hkv, d});
  const Layout layout(o.layout, n * P, P);
  const std::vector<int64_t> qpos = layout.positions(rank);
  const std::vector<int64_t> kpos[2] = {qpos, layout.positions((rank + P - 1) % P)};
  const Tokens qt{qpos, {}}, kt[2] = {{kpos[0], {}}, {kpos[1], {}}};
  const Mask mask = o.causal ? Mask::causal_mask() : Mask::none();
  KernelConfig one;
  one.threads = 1;
  start_together();
  KernelRates r;
  double flops = 0;
  auto both = [&](auto&& call) {
    flops = 0;
    for (const Tokens& t : kt) flops += call(t).flops;
  };
  ForwardState state(b, n, hq, d);
  const double fwd = seconds_per_call(
      [&] {
        both([&](const Tokens& t) {
          return attention_forward_block(q, qt, k, v, t, mask, state, one);
        });
      },
      3, o.min_seconds);
  r.forward = flops / fwd;
  const double bwd = seconds_per_call(
      [&] {
        both([&](const Tokens& t) {
          return attention_backward_block(q, qt, k, v, t, mask, dout, lse, delta, dq, dk, dv, one);
        });
      },
      3, o.min_seconds);
  r.backward = flops / bwd;
  return r;
}

// Seconds for the ring's transfer pattern over `comm`: every rank sends `bytes` to the next
// and receives from the previous at the same moment (so a shared medium, such as one
// loopback, is shared as in the ring). Best of `repeats`, after `warmup` untimed shifts (the
// first makes the connections); each shift counts as long as its slowest rank took.
double ring_shift_seconds(Communicator& comm, size_t bytes, int warmup, int repeats) {
  const int p = comm.size(), r = comm.rank();
  double best = 1e30;
  for (int i = 0; i < warmup + repeats; ++i) {
    Buffer out(bytes);
    comm.barrier();
    const double t0 = now_seconds();
    Request recv = comm.irecv(bytes, (r + p - 1) % p, i);
    Request send = comm.isend(std::move(out), (r + 1) % p, i);
    recv.take();
    send.wait();
    double mine = now_seconds() - t0;
    std::vector<double> all(p);
    comm.allgather(&mine, all.data(), sizeof(double));
    if (i >= warmup) best = std::min(best, *std::max_element(all.begin(), all.end()));
  }
  return best;
}

// What ring.cc asks before its forward's barrier, for the device the local plan models.
bool cpu_lends_sent_buffers(const Communicator& comm) {
  return make_device(DeviceOptions{}, comm.rank())->lends_sent_buffers(comm);
}

// One rank per process: this process times its rank's kernel while the others time theirs,
// then the link as the ring uses it: latency from an 8-byte shift, bandwidth from a block.
void measure_over_comm(const LocalOptions& o, Communicator& comm, LocalMeasurement& m) {
  CTXPAR_CHECK(comm.size() == o.ranks, "local hardware: mpirun started ", comm.size(),
               " processes but the plan has ", o.ranks, " context-parallel ranks; use mpirun -n ",
               o.ranks, " (or plan for ", comm.size(), " context-parallel ranks)");
  const KernelRates mine = rates_of_one_rank(o, comm.rank(), [&] { comm.barrier(); });
  double sums[2] = {mine.forward, mine.backward};
  comm.allreduce(sums, 2);
  m.forward_flops = sums[0] / o.ranks;
  m.backward_flops = sums[1] / o.ranks;
  m.transport = transport_name(comm.transport());
  m.lends_sent_buffers = cpu_lends_sent_buffers(comm);
  if (o.ranks == 1) {  // nothing to send: no link, as for one thread
    m.link.gbytes_per_second = 1e6;
    return;
  }
  const size_t bytes = std::max<size_t>(8, static_cast<size_t>(o.message_bytes));
  m.handover_seconds = ring_shift_seconds(comm, 8, 1, 7);
  // A block over a slow link takes seconds: two, after the small shifts made the connections.
  m.block_message_seconds = ring_shift_seconds(comm, bytes, 0, 2);
  m.link.latency_us = m.handover_seconds * 1e6;
  m.link.gbytes_per_second = static_cast<double>(bytes) /
                             std::max(m.block_message_seconds - m.handover_seconds, 1e-9) / 1e9;
}

}  // namespace

LocalMeasurement measure_local(const LocalOptions& o) {
  CTXPAR_CHECK(o.block_tokens > 0 && o.heads > 0 && o.kv_heads > 0 && o.head_dim > 0 && o.batch > 0,
               "local hardware: block, heads, kv heads, head dim and batch must be > 0");
  CTXPAR_CHECK(o.ranks >= 1, "local hardware: ranks must be >= 1");
  LocalMeasurement m;
  m.mem_gb = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / 1e9;
  m.cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  if (o.comm) {
    measure_over_comm(o, *o.comm, m);
    return m;
  }
  // More rank threads than cores only share the cores: P ranks on C < P cores each get C/P of
  // a core. Timing all P threads (P = 4096 once took minutes and gigabytes) measures the same
  // share, so C threads run, on ranks spread over the ring, and their rate is scaled by C/P.
  const int running = std::min(o.ranks, m.cores);
  std::vector<KernelRates> rates(running);
  std::atomic<int> ready{0};
  auto start_together = [&] {
    ready.fetch_add(1);
    while (ready.load() < running) std::this_thread::yield();
  };
  std::vector<std::thread> threads;
  for (int i = 0; i < running; ++i) {
    const int rank = static_cast<int>(int64_t{i} * o.ranks / running);
    threads.emplace_back([&, i, rank] { rates[i] = rates_of_one_rank(o, rank, start_together); });
  }
  for (auto& t : threads) t.join();
  const double share = static_cast<double>(running) / o.ranks;
  for (const auto& r : rates) {
    m.forward_flops += r.forward / running * share;
    m.backward_flops += r.backward / running * share;
  }

  // The transport. The simulated link is a model we configure (latency + bytes / bandwidth,
  // one message at a time), so the plan uses its figures; what it adds is the hand-over of a
  // message between two rank threads, timed here with the link off. A block-sized message is
  // also timed through the link, for the record.
  auto time_messages = [](const SimulatedLink& link, size_t size, int repeats) {
    ThreadsOptions to;
    to.link = link;
    double best = 1e30;
    run_threads(
        2,
        [&](Communicator& comm) {
          for (int i = 0; i < repeats; ++i) {
            comm.barrier();
            const double t0 = now_seconds();
            if (comm.rank() == 0) {
              comm.isend(Buffer(size), 1, 0).wait();
              comm.irecv(8, 1, 1).take();
            } else {
              comm.irecv(size, 0, 0).take();
              comm.isend(Buffer(8), 0, 1).wait();
            }
            if (comm.rank() == 0) best = std::min(best, now_seconds() - t0);
          }
        },
        to);
    return best;
  };
  run_threads(1, [&](Communicator& comm) { m.lends_sent_buffers = cpu_lends_sent_buffers(comm); });
  // A ping-pong of two small messages: half of it is one hand-over.
  m.handover_seconds = time_messages(SimulatedLink{}, 8, 7) / 2;
  const size_t bytes = std::max<size_t>(8, static_cast<size_t>(o.message_bytes));
  if (o.link.gbytes_per_second > 0 || o.link.latency_us > 0)
    m.block_message_seconds = time_messages(o.link, bytes, 2) - m.handover_seconds -
                              o.link.latency_us * 1e-6 -
                              8 / std::max(o.link.gbytes_per_second * 1e9, 1.0);
  m.link.gbytes_per_second = o.link.gbytes_per_second > 0 ? o.link.gbytes_per_second : 1e6;
  m.link.latency_us = o.link.latency_us + m.handover_seconds * 1e6;
  return m;
}

HardwareSpec local_hardware(const LocalMeasurement& m, int ranks) {
  HardwareSpec h;
  h.name = "local";
  h.flops = m.forward_flops;  // already per rank, measured with all ranks running
  h.backward_flops = m.backward_flops;
  h.efficiency = 1.0;
  h.mem_gb = m.mem_gb;
  h.intra = m.link;
  h.inter = m.link;
  h.devices_per_node = std::max(1, ranks);
  h.lends_sent_buffers = m.lends_sent_buffers;
  return h;
}

}  // namespace ctxpar
