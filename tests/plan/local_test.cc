// The `local` preset and the schedule simulation against a real run of our ring on the threads
// transport, where transfers dominate (the simulated link is deterministic, so the check is
// robust to a busy machine; the compute-dominated comparison is scripts/plot_plan.py's).
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar {
namespace {

TEST(Local, MeasuresKernelAndTransport) {
  LocalOptions o;
  o.ranks = 2;
  o.block_tokens = 128;
  o.heads = o.kv_heads = 1;
  o.head_dim = 16;
  o.link = {0.5, 10};
  o.message_bytes = 4096;
  o.min_seconds = 0.01;
  const LocalMeasurement m = measure_local(o);
  EXPECT_GT(m.forward_flops, 1e6);
  EXPECT_GT(m.backward_flops, 1e6);
  EXPECT_GT(m.handover_seconds, 0);
  EXPECT_DOUBLE_EQ(m.link.gbytes_per_second, 0.5);
  EXPECT_GE(m.link.latency_us, 10);
  const HardwareSpec h = local_hardware(m, 2);
  EXPECT_EQ(h.name, "local");
  EXPECT_DOUBLE_EQ(h.effective_flops(), m.forward_flops);
  EXPECT_DOUBLE_EQ(h.effective_backward_flops(), m.backward_flops);
}

// Forward and backward wall time of the real ring (slowest rank) on P threads.
std::pair<double, double> run_ring(int P, int64_t T, int64_t D, const SimulatedLink& link) {
  std::vector<double> fwd(P), bwd(P);
  const Layout layout(LayoutKind::zigzag, T, P);
  ThreadsOptions to;
  to.link = link;
  run_threads(
      P,
      [&](Communicator& comm) {
        StrategyOptions o;
        o.mask = Mask::causal_mask();
        auto ring = Strategy::create(comm, o);
        const int64_t n = T / P;
        Tensor q(DType::f32, {1, n, 1, D}), k(DType::f32, {1, n, 1, D}),
            v(DType::f32, {1, n, 1, D});
        Tensor out(DType::f32, {1, n, 1, D}), dout(DType::f32, {1, n, 1, D});
        Tensor dq(DType::f32, {1, n, 1, D}), dk(DType::f32, {1, n, 1, D}),
            dv(DType::f32, {1, n, 1, D});
        Tensor lse(DType::f32, {1, 1, n});
        const auto pos = layout.positions(comm.rank());
        const Tokens tokens{pos, {}};
        using Clock = std::chrono::steady_clock;
        comm.barrier();
        auto t0 = Clock::now();
        ring->forward(q, k, v, tokens, out, lse);
        fwd[comm.rank()] = std::chrono::duration<double>(Clock::now() - t0).count();
        comm.barrier();
        t0 = Clock::now();
        ring->backward(q, k, v, tokens, out, lse, dout, dq, dk, dv);
        bwd[comm.rank()] = std::chrono::duration<double>(Clock::now() - t0).count();
      },
      to);
  return {*std::max_element(fwd.begin(), fwd.end()), *std::max_element(bwd.begin(), bwd.end())};
}

// Transfers of ~0.14 s a block against ~1 ms of compute: the prediction must be within 15%
// of the measured forward and backward, for P = 2 and 4.
TEST(Local, PredictsTheTransferDominatedRing) {
  const int64_t D = 16, n = 512;
  const SimulatedLink link{0.0005, 0};
  for (int P : {2, 4}) {
    LocalOptions o;
    o.ranks = P;
    o.block_tokens = n;
    o.heads = o.kv_heads = 1;
    o.head_dim = D;
    o.link = link;
    o.message_bytes = 4096;  // the timed message is for the record; keep it short
    o.min_seconds = 0.01;
    const HardwareSpec h = local_hardware(measure_local(o), P);
    RingProblem pr;
    pr.ranks = P;
    pr.seq = n * P;
    pr.heads = pr.kv_heads = 1;
    pr.head_dim = D;
    pr.dtype_bytes = 4;
    pr.layout = LayoutKind::zigzag;
    pr.causal = true;
    pr.tile = 64;
    pr.links = {h.intra};
    pr.flops_per_second = {h.flops};
    pr.backward_flops_per_second = {h.backward_flops};
    pr.barrier_after_forward = ring_forward_ends_with_barrier(P, h.lends_sent_buffers);
    const RingSimulation sim = simulate_ring(pr);
    // The fastest of 3 runs: the simulated link makes the measured time a floor that noise only
    // adds to (one stall of ~21 ms on a loaded machine was enough to miss 15 % at P = 2), and
    // the prediction's own figures are best-of measurements too.
    double fwd = 1e30, bwd = 1e30;
    for (int run = 0; run < 3; ++run) {
      const auto [f, b] = run_ring(P, n * P, D, link);
      fwd = std::min(fwd, f), bwd = std::min(bwd, b);
    }
    EXPECT_NEAR(sim.forward_seconds / fwd, 1.0, 0.15) << "P=" << P << " measured " << fwd;
    EXPECT_NEAR(sim.backward_seconds / bwd, 1.0, 0.15) << "P=" << P << " measured " << bwd;
    EXPECT_GT(sim.exposed_comm / sim.seconds, 0.5);  // transfer-dominated indeed
  }
}

}  // namespace
}  // namespace ctxpar
