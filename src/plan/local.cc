// The `local` hardware preset: this machine, measured on the spot. The kernel's throughput is
// timed on one ring step's block pair (one thread per rank, as `ctxpar attention` runs), the
// cores are shared by the ranks, and the threads transport's simulated link is timed with a
// real message. See docs/plan.md, "Checked against ourselves".
#include <algorithm>
#include <chrono>
#include <numeric>
#include <thread>

#include <unistd.h>

#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/kernel.h"
#include "ctxpar/plan.h"

namespace ctxpar {
namespace {

double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Best of `repeats` timings of fn(), each repeated until it has run for at least `min_seconds`.
template <typename Fn>
double seconds_per_call(Fn&& fn, int repeats = 3, double min_seconds = 0.05) {
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

LocalMeasurement measure_local(const LocalOptions& o) {
  CTXPAR_CHECK(o.block_tokens > 0 && o.heads > 0 && o.kv_heads > 0 && o.head_dim > 0 && o.batch > 0,
               "local hardware: block, heads, kv heads, head dim and batch must be > 0");
  LocalMeasurement m;
  // One unmasked block pair; large blocks are measured on a 1024-token slice (the rate no
  // longer depends on the size there) to keep the measurement short.
  const int64_t n = std::min<int64_t>(o.block_tokens, 1024);
  const int64_t b = o.batch, hq = o.heads, hkv = o.kv_heads, d = o.head_dim;
  Tensor q(o.dtype, {b, n, hq, d}), k(o.dtype, {b, n, hkv, d}), v(o.dtype, {b, n, hkv, d});
  Tensor out(o.dtype, {b, n, hq, d}), dout(o.dtype, {b, n, hq, d});
  Tensor lse(DType::f32, {b, hq, n}), delta(DType::f32, {b, hq, n});
  Tensor dq(DType::f32, {b, n, hq, d}), dk(DType::f32, {b, n, hkv, d}), dv(DType::f32, {b, n, hkv, d});
  std::vector<int64_t> qpos(n), kpos(n);
  std::iota(qpos.begin(), qpos.end(), n);
  std::iota(kpos.begin(), kpos.end(), 0);
  const Tokens qt{qpos, {}}, kt{kpos, {}};
  const Mask none;
  KernelConfig one;
  one.threads = 1;
  ForwardState state(b, n, hq, d);
  double flops = 0;
  const double fwd = seconds_per_call([&] {
    flops = attention_forward_block(q, qt, k, v, kt, none, state, one).flops;
  });
  m.forward_flops = flops / fwd;
  const double bwd = seconds_per_call([&] {
    flops = attention_backward_block(q, qt, k, v, kt, none, dout, lse, delta, dq, dk, dv, one).flops;
  });
  m.backward_flops = flops / bwd;
  m.mem_gb = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * sysconf(_SC_PAGE_SIZE) / 1e9;
  m.cores = o.cores > 0 ? o.cores : std::max(1u, std::thread::hardware_concurrency());

  // The transport: time one block-sized message over the simulated link (or the plain
  // hand-over when no link is simulated) between two ranks.
  const size_t bytes = std::max<size_t>(1, static_cast<size_t>(o.message_bytes));
  ThreadsOptions to;
  to.link = o.link;
  double small = 0, large = 0;
  run_threads(2, [&](Communicator& comm) {
    auto one_message = [&](size_t size) {
      comm.barrier();
      const double t0 = now_seconds();
      if (comm.rank() == 0) {
        comm.isend(Buffer(size), 1, 0).wait();
      } else {
        comm.irecv(size, 0, 0).take();
      }
      return now_seconds() - t0;
    };
    double s = 1e30, l = 1e30;
    for (int i = 0; i < 3; ++i) s = std::min(s, one_message(8)), l = std::min(l, one_message(bytes));
    if (comm.rank() == 1) small = s, large = l;
  }, to);
  m.link.latency_us = small * 1e6;
  m.link.gbytes_per_second = bytes / std::max(large - small, 1e-9) / 1e9;
  return m;
}

HardwareSpec local_hardware(const LocalMeasurement& m, int ranks) {
  HardwareSpec h;
  h.name = "local";
  // Ranks share the cores: each gets cores / ranks of one (at most one: a rank is one thread).
  const double share = std::min(1.0, static_cast<double>(m.cores) / std::max(1, ranks));
  h.flops = m.forward_flops * share;
  h.efficiency = 1.0;
  h.backward_flops = m.backward_flops * share;
  h.mem_gb = m.mem_gb;
  h.intra = m.link;
  h.inter = m.link;
  h.devices_per_node = std::max(1, ranks);
  return h;
}

}  // namespace ctxpar
