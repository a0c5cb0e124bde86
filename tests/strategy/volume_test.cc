// Communication volume of every strategy against its formula (bytes this rank sent and
// received in one call, from the communicator's counters), and ring's per-rank memory.
// Formulas: docs/ring.md, docs/allgather.md, docs/ulysses.md, docs/hybrid.md.
#include <gtest/gtest.h>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

struct Case {
  Problem pr;
  int p;
  StrategyOptions opt;
};

Case make_case(StrategyKind kind, int p, DType dtype, bool documents, int u = 0, int groups = 0) {
  Case c;
  c.pr.batch = 2;
  c.pr.tokens = 48;
  c.pr.hq = 8;
  c.pr.hkv = 2;
  c.pr.d = 16;
  c.pr.dtype = dtype;
  c.pr.mask = documents ? parse_mask("causal+documents") : Mask::causal_mask();
  c.pr.build();
  c.p = p;
  c.opt.kind = kind;
  c.opt.mask = c.pr.mask;
  c.opt.ulysses_degree = u;
  c.opt.head_groups = groups;
  // The formulas are the whole-block ring's (auto would move only what is needed under a
  // documents mask: needed_test.cc counts those bytes).
  c.opt.exchange = Exchange::ring;
  return c;
}

// Bytes of one K/V block of `tokens` tokens and `heads` KV heads as the ring sends it.
uint64_t kv_block(const Problem& pr, int64_t tokens, int64_t heads) {
  return 2 * pr.batch * tokens * heads * pr.d * dtype_size(pr.dtype) + tokens * 8 +
         (pr.mask.documents ? tokens * 4 : 0);
}
uint64_t grad_block(const Problem& pr, int64_t tokens, int64_t heads) {
  return 2 * pr.batch * tokens * heads * pr.d * 4;
}
uint64_t ring_forward_bytes(const Problem& pr, int p, int64_t tokens, int64_t heads) {
  return (p - 1) * kv_block(pr, tokens, heads);
}
uint64_t ring_backward_bytes(const Problem& pr, int p, int64_t tokens, int64_t heads) {
  return (p - 1) * (kv_block(pr, tokens, heads) + grad_block(pr, tokens, heads));
}
// Ulysses over n ranks: positions (+docs) all-gathered, then one all-to-all in and one back,
// each sending n-1 of its n chunks. out / dout are fp32 in these tests.
uint64_t ulysses_bytes(const Problem& pr, int n, int64_t tl, bool backward) {
  const int64_t hq = pr.hq / n, rep = pr.hq / pr.hkv;
  // KV heads per rank: split, or replicated (one head, or one per query head).
  const int64_t hk = pr.hkv % n == 0 ? pr.hkv / n : rep % hq == 0 ? 1 : hq;
  const int64_t es = dtype_size(pr.dtype), b = pr.batch, d = pr.d;
  uint64_t in = b * tl * (hq + 2 * hk) * d * es, back;
  if (!backward) {
    back = b * tl * hq * d * 4 + b * hq * tl * 4;  // out + lse
  } else {
    in += b * tl * hq * d * 4 + 2 * b * hq * tl * 4;  // dout + lse + delta
    back = b * tl * (hq + 2 * hk) * d * 4;            // dq, dk, dv in fp32
  }
  return (n - 1) * (tl * 8 + (pr.mask.documents ? tl * 4 : 0) + in + back);
}

uint64_t expected_bytes(const Case& c, bool backward) {
  const Problem& pr = c.pr;
  const int64_t tl = pr.tokens / c.p;
  switch (c.opt.kind) {
    case StrategyKind::ring:
      return backward ? ring_backward_bytes(pr, c.p, tl, pr.hkv)
                      : ring_forward_bytes(pr, c.p, tl, pr.hkv);
    case StrategyKind::allgather: {
      const int64_t groups = c.opt.head_groups ? c.opt.head_groups : pr.hkv;  // auto: 2 here
      uint64_t gather = (c.p - 1) * (2 * pr.batch * tl * pr.hkv * pr.d * dtype_size(pr.dtype) +
                                     groups * tl * (8 + (pr.mask.documents ? 4 : 0)));
      return gather + (backward ? (c.p - 1) * grad_block(pr, tl, pr.hkv) : 0);
    }
    case StrategyKind::ulysses:
      return ulysses_bytes(pr, c.p, tl, backward);
    case StrategyKind::hybrid: {
      const int u = c.opt.ulysses_degree, rings = c.p / u;
      const int64_t hq = pr.hq / u, rep = pr.hq / pr.hkv;
      const int64_t hk = pr.hkv % u == 0 ? pr.hkv / u : rep % hq == 0 ? 1 : hq;
      return ulysses_bytes(pr, u, tl, backward) + (backward
                                                       ? ring_backward_bytes(pr, rings, u * tl, hk)
                                                       : ring_forward_bytes(pr, rings, u * tl, hk));
    }
  }
  return 0;
}

void check_volume(const Case& c) {
  const RunResult res = run_sharded(c.pr, c.p, LayoutKind::zigzag, c.opt);
  for (int r = 0; r < c.p; ++r) {
    const std::string where = std::string(strategy_name(c.opt.kind)) + " P=" + std::to_string(c.p) +
                              " u=" + std::to_string(c.opt.ulysses_degree) + " " +
                              dtype_name(c.pr.dtype) + " mask=" + c.pr.mask.describe() + " rank " +
                              std::to_string(r);
    EXPECT_EQ(res.forward_stats[r].bytes_sent, expected_bytes(c, false)) << where << " forward";
    EXPECT_EQ(res.forward_stats[r].bytes_received, expected_bytes(c, false)) << where << " forward";
    EXPECT_EQ(res.backward_stats[r].bytes_sent, expected_bytes(c, true)) << where << " backward";
    EXPECT_EQ(res.backward_stats[r].bytes_received, expected_bytes(c, true))
        << where << " backward";
    EXPECT_GT(res.forward_stats[r].attention_flops, 0) << where;
    EXPECT_GT(res.forward_stats[r].peak_bytes, 0u) << where;
    EXPECT_GE(res.forward_stats[r].wall_seconds, res.forward_stats[r].busy_seconds) << where;
  }
}

TEST(Volume, RingForwardSendsExactlyPMinusOneKvBlocks) {
  for (int p : {1, 2, 3, 4, 8})
    for (DType dt : {DType::f32, DType::bf16})
      for (bool docs : {false, true}) {
        Case c = make_case(StrategyKind::ring, p, dt, docs);
        check_volume(c);
        // The communicator's own counters: P-1 point-to-point sends of one block each.
        const RunResult res = run_sharded(c.pr, p, LayoutKind::contiguous, c.opt, false);
        for (int r = 0; r < p; ++r) {
          EXPECT_EQ(res.counters[r].calls_of(CommKind::send), uint64_t(p - 1));
          EXPECT_EQ(res.counters[r].sent_by(CommKind::send), (p - 1) * kv_block(c.pr, 48 / p, 2));
        }
      }
  // bf16 K/V travel as bf16: half the K/V bytes of fp32.
  Problem a = make_case(StrategyKind::ring, 2, DType::f32, false).pr;
  Problem b = make_case(StrategyKind::ring, 2, DType::bf16, false).pr;
  EXPECT_EQ(kv_block(a, 24, 2) - 24 * 8, 2 * (kv_block(b, 24, 2) - 24 * 8));
}

TEST(Volume, AllGatherUlyssesHybridMatchTheirFormulas) {
  for (int p : {2, 3, 4, 8})
    for (bool docs : {false, true}) {
      check_volume(make_case(StrategyKind::allgather, p, DType::f32, docs));
      check_volume(make_case(StrategyKind::allgather, p, DType::bf16, docs, 0, 1));
      if (p != 3) check_volume(make_case(StrategyKind::ulysses, p, DType::bf16, docs));
    }
  for (auto [p, u] : {std::pair{2, 2}, {4, 2}, {8, 2}, {8, 4}, {3, 1}})
    for (bool docs : {false, true})
      check_volume(make_case(StrategyKind::hybrid, p, DType::f32, docs, u));
}

// Ring holds its state and two K/V blocks (the one computed on, the one arriving) whatever P:
// for a fixed T/P its peak does not grow with P. All-gather's does (it gathers T), which also
// shows the tracker can tell them apart.
TEST(Volume, RingPeakBytesDoNotGrowWithP) {
  auto peak = [](StrategyKind kind, int p, bool backward) {
    Problem pr;
    pr.tokens = 16 * p;
    pr.hq = 4;
    pr.hkv = 2;
    pr.mask = Mask::causal_mask();
    pr.build();
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = pr.mask;
    opt.head_groups = 1;
    RunResult res = run_sharded(pr, p, LayoutKind::zigzag, opt, backward);
    size_t m = 0;
    for (int r = 0; r < p; ++r)
      m = std::max(m,
                   backward ? res.backward_stats[r].peak_bytes : res.forward_stats[r].peak_bytes);
    return m;
  };
  const size_t block = 2 * 16 * 2 * 16 * 4 + 16 * 8;  // K + V + positions of 16 tokens
  for (bool bwd : {false, true}) {
    // Small P hold a little less (the last step receives nothing, and backward's dK/dV
    // pipeline fills from P = 4 on); from there the peak is the same for every P.
    const size_t p4 = peak(StrategyKind::ring, 4, bwd);
    EXPECT_GE(p4, 2 * block);
    for (int p : {2, 3, 8, 16}) EXPECT_LE(peak(StrategyKind::ring, p, bwd), p4) << "P=" << p;
  }
  EXPECT_GT(peak(StrategyKind::allgather, 8, false), peak(StrategyKind::allgather, 2, false));
}

}  // namespace
}  // namespace ctxpar::testing
