// Communication volumes: the formulas' scaling laws, and equality with what our communicators
// count when the real strategies run the same configuration on the threads transport.
#include <gtest/gtest.h>

#include <mutex>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy.h"

namespace ctxpar {
namespace {

// Ring: (P-1)/P of the sequence's K/V per device, so constant in P for large P; Ulysses:
// ~1/P per device; all-gather like the ring.
TEST(CommVolume, ScalingLaws) {
  const int64_t T = 1 << 20, H = 32, D = 128;
  auto total = [&](StrategyKind k, int P) {
    const CommVolume c = attention_comm_bytes(k, P, 0, 1, T, H, H, D, 2);
    return c.forward_bytes + c.backward_bytes;
  };
  const double kv_all = 2.0 * T * H * D * 2;  // the whole sequence's K and V, bf16
  for (int P : {2, 4, 8, 16}) {
    const double n = double(T) / P;
    const CommVolume ring = attention_comm_bytes(StrategyKind::ring, P, 0, 1, T, H, H, D, 2);
    EXPECT_DOUBLE_EQ(ring.forward_bytes, (P - 1) * (kv_all / P + 8 * n));
    EXPECT_NEAR(ring.forward_bytes / kv_all, 1.0, 1.0 / P);  // (P-1)/P: ~constant in P
    // Ulysses per device shrinks as 1/P: each all-to-all sends (P-1)/P of a local shard of
    // T/P tokens, so bytes * P^2 / (P-1) is constant (to the 8-byte positions, < 1%).
    auto ulysses_law = [&](int p) { return total(StrategyKind::ulysses, p) * p * p / (p - 1); };
    EXPECT_NEAR(ulysses_law(2 * P) / ulysses_law(P), 1.0, 0.01) << "P=" << P;
    // The ring sends (P-1)/P of the sequence's K/V (and dK, dV) per device: -> constant.
    auto ring_law = [&](int p) { return total(StrategyKind::ring, p) * p / (p - 1); };
    EXPECT_NEAR(ring_law(2 * P) / ring_law(P), 1.0, 1e-12) << "P=" << P;
    EXPECT_LT(total(StrategyKind::ulysses, P), total(StrategyKind::ring, P));
  }
  EXPECT_EQ(total(StrategyKind::ring, 1), 0);
  EXPECT_EQ(total(StrategyKind::ulysses, 1), 0);
}

struct Config {
  StrategyKind kind;
  int ranks, ulysses_degree;
  int64_t batch, heads, kv_heads;
  DType dtype;
};

// Runs forward + backward of the real strategy on P threads; returns every rank's bytes sent
// for forward and for backward, as StrategyStats counts them from the communicator.
std::vector<std::pair<uint64_t, uint64_t>> measure(const Config& c, int64_t T, int64_t D) {
  std::vector<std::pair<uint64_t, uint64_t>> sent(c.ranks);
  const Layout layout(LayoutKind::zigzag, T, c.ranks);
  run_threads(c.ranks, [&](Communicator& comm) {
    StrategyOptions o;
    o.kind = c.kind;
    o.ulysses_degree = c.ulysses_degree;
    o.mask = Mask::causal_mask();
    auto strategy = Strategy::create(comm, o);
    const int64_t n = T / c.ranks;
    Tensor q(c.dtype, {c.batch, n, c.heads, D}), k(c.dtype, {c.batch, n, c.kv_heads, D});
    Tensor v(c.dtype, {c.batch, n, c.kv_heads, D}), out(c.dtype, {c.batch, n, c.heads, D});
    Tensor dout(c.dtype, {c.batch, n, c.heads, D}), dq(c.dtype, {c.batch, n, c.heads, D});
    Tensor dk(c.dtype, {c.batch, n, c.kv_heads, D}), dv(c.dtype, {c.batch, n, c.kv_heads, D});
    Tensor lse(DType::f32, {c.batch, c.heads, n});
    const std::vector<int64_t> pos = layout.positions(comm.rank());
    const Tokens tokens{pos, {}};
    strategy->forward(q, k, v, tokens, out, lse);
    const uint64_t f = strategy->last_stats().bytes_sent;
    strategy->backward(q, k, v, tokens, out, lse, dout, dq, dk, dv);
    sent[comm.rank()] = {f, strategy->last_stats().bytes_sent};
  });
  return sent;
}

TEST(CommVolume, EqualsOurCommunicatorsCounts) {
  const int64_t T = 256, D = 16;
  const Config configs[] = {
      {StrategyKind::ring, 2, 0, 1, 4, 2, DType::f32},
      {StrategyKind::ring, 4, 0, 2, 4, 4, DType::bf16},
      {StrategyKind::allgather, 2, 0, 1, 4, 2, DType::f32},
      {StrategyKind::allgather, 4, 0, 1, 8, 4, DType::bf16},
      {StrategyKind::ulysses, 2, 0, 1, 4, 2, DType::f32},
      {StrategyKind::ulysses, 4, 0, 2, 4, 2, DType::bf16},  // Hkv < P: KV heads replicated
      {StrategyKind::hybrid, 4, 2, 1, 4, 2, DType::f32},
      {StrategyKind::hybrid, 4, 2, 1, 4, 4, DType::bf16},
  };
  for (const Config& c : configs) {
    const auto sent = measure(c, T, D);
    const CommVolume want = attention_comm_bytes(c.kind, c.ranks, c.ulysses_degree, c.batch, T,
                                                 c.heads, c.kv_heads, D, dtype_size(c.dtype));
    for (int r = 0; r < c.ranks; ++r) {
      EXPECT_EQ(double(sent[r].first), want.forward_bytes)
          << strategy_name(c.kind) << " P=" << c.ranks << " rank " << r << " forward";
      EXPECT_EQ(double(sent[r].second), want.backward_bytes)
          << strategy_name(c.kind) << " P=" << c.ranks << " rank " << r << " backward";
    }
  }
}

}  // namespace
}  // namespace ctxpar
