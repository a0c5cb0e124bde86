// Finite inputs whose scores or gradients go beyond the fp32 range: the LSE came out +inf and
// O off by 4 with no error. Now every rank of every strategy fails with the same message,
// naming the first bad element by its global token and head; a row whose every key is
// masked (LSE = -inf, O = 0) stays legitimate. Each case runs with a short timeout: no rank
// may wait for one that gave up.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

const StrategyKind kAll[] = {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses,
                             StrategyKind::hybrid};

constexpr int kRanks = 4;
constexpr int64_t kT = 256, kHq = 4, kHkv = 2, kD = 16;

// q, k, v, dout [2, T, H, D]; q at (batch 1, token 200, head 1) and k at (batch 1, token 10,
// kv head 0, which query head 1 reads) are 1e20 in every dim: their score is 1.6e41 x scale,
// +inf in fp32, with every input finite. Every other score stays finite.
struct Overflow {
  Tensor full[4];
  explicit Overflow(bool overflow, bool positive = false) {
    for (int i = 0; i < 4; ++i) {
      full[i] = Tensor(DType::f32, {2, kT, i == 1 || i == 2 ? kHkv : kHq, kD});
      fill_normal(full[i], 50 + i);
      if (positive && i < 2)  // q, k > 0: every score positive
        for (int64_t j = 0; j < full[i].numel(); ++j)
          full[i].ptr<float>()[j] = std::fabs(full[i].ptr<float>()[j]) + 0.1f;
    }
    if (!overflow) return;
    for (int64_t d = 0; d < kD; ++d) {
      full[0].ptr<float>()[full[0].view().offset(1, 200, 1, d)] = 1e20f;
      full[1].ptr<float>()[full[1].view().offset(1, 10, 0, d)] = 1e20f;
    }
  }
};

std::vector<std::string> run(const Overflow& in, StrategyKind kind, LayoutKind layout_kind,
                             bool backward, float scale = 0) {
  const Layout layout(layout_kind, kT, kRanks);
  return errors_on_ranks(kRanks, [&](Communicator& comm) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = Mask::causal_mask();
    opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
    if (scale > 0) opt.kernel.scale = scale;
    auto s = Strategy::create(comm, opt);
    const int r = comm.rank();
    Tensor q = layout.shard(in.full[0], r), k = layout.shard(in.full[1], r);
    Tensor v = layout.shard(in.full[2], r), dout = layout.shard(in.full[3], r);
    const std::vector<int64_t> pos = layout.positions(r);
    const int64_t tl = pos.size();
    Tensor o(DType::f32, {2, tl, kHq, kD}), lse(DType::f32, {2, kHq, tl});
    Tensor dq(DType::f32, {2, tl, kHq, kD}), dk(DType::f32, {2, tl, kHkv, kD});
    Tensor dv(DType::f32, {2, tl, kHkv, kD});
    const Tokens tok{pos, {}};
    s->forward(q, k, v, tok, o, lse);
    if (backward) s->backward(q, k, v, tok, o, lse, dout, dq, dk, dv);
  });
}

TEST(Overflow, ScoresBeyondFp32NameTheGlobalTokenAndHeadOnEveryRank) {
  const Overflow in(true);
  for (StrategyKind kind : kAll)
    for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
      const auto t0 = std::chrono::steady_clock::now();
      const auto errors = run(in, kind, layout, false);
      const double seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      const std::string what = std::string(strategy_name(kind)) + " forward: non-finite output";
      for (int r = 0; r < kRanks; ++r) {
        const std::string& e = errors[r];
        EXPECT_NE(e.find(what), std::string::npos)
            << layout_name(layout) << " rank " << r << ": " << e;
        EXPECT_NE(e.find("lse = inf at token position 200, batch 1, head 1"), std::string::npos)
            << strategy_name(kind) << " " << layout_name(layout) << " rank " << r << ": " << e;
        EXPECT_NE(e.find("beyond the fp32 range"), std::string::npos) << e;
      }
      EXPECT_LT(seconds, 4.0) << "no rank may wait for the timeout";
    }
}

// A huge softmax scale overflows every score of every row (q, k > 0: to +inf): the first row
// named is the first global token (batch 0, token 0, head 0), whichever rank holds it.
TEST(Overflow, HugeScaleNamesTheFirstTokenOfTheGroup) {
  const Overflow in(false, true);
  for (StrategyKind kind : kAll)
    for (LayoutKind layout : {LayoutKind::contiguous, LayoutKind::striped}) {
      const auto errors = run(in, kind, layout, false, 1e38f);
      for (int r = 0; r < kRanks; ++r)
        EXPECT_NE(errors[r].find("at token position 0, batch 0, head 0"), std::string::npos)
            << strategy_name(kind) << " " << layout_name(layout) << " rank " << r << ": "
            << errors[r];
    }
}

// Gradients beyond fp32 from finite inputs: dO at (batch 0, token 100, head 2) is 3e38, so
// dO . v overflows; every rank fails the backward naming the first bad gradient row.
TEST(Overflow, GradientsBeyondFp32FailTheBackwardOnEveryRank) {
  Overflow in(false);
  for (int64_t d = 0; d < kD; ++d)
    in.full[3].ptr<float>()[in.full[3].view().offset(0, 100, 2, d)] = 3e38f;
  for (StrategyKind kind : kAll) {
    const auto errors = run(in, kind, LayoutKind::zigzag, true);
    for (int r = 0; r < kRanks; ++r) {
      EXPECT_NE(errors[r].find(std::string(strategy_name(kind)) + " backward: non-finite output"),
                std::string::npos)
          << "rank " << r << ": " << errors[r];
      EXPECT_NE(errors[r].find("at token position 0, batch 0, head 1"), std::string::npos)
          << strategy_name(kind) << " rank " << r << ": " << errors[r];
    }
  }
}

// Finite inputs with finite results: no error, forward and backward; fully masked rows
// (padding: LSE = -inf, O = 0) are not non-finite outputs.
TEST(Overflow, FiniteResultsAndFullyMaskedRowsPass) {
  const Overflow in(false);
  for (StrategyKind kind : kAll) {
    const auto errors = run(in, kind, LayoutKind::zigzag, true);
    for (int r = 0; r < kRanks; ++r) EXPECT_EQ(errors[r], "") << strategy_name(kind);
  }
  // Padding tokens: the layout pads T = 250 to 256; their rows have every key masked.
  const Layout layout(LayoutKind::contiguous, 250, kRanks);
  ASSERT_GT(layout.padding(), 0);
  Tensor full[3];
  for (int i = 0; i < 3; ++i) {
    full[i] = Tensor(DType::f32, {1, 250, kHq, kD});
    fill_normal(full[i], 70 + i);
  }
  for (StrategyKind kind : kAll) {
    const auto errors = errors_on_ranks(kRanks, [&](Communicator& comm) {
      StrategyOptions opt;
      opt.kind = kind;
      opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
      auto s = Strategy::create(comm, opt);
      const int r = comm.rank();
      Tensor q = layout.shard(full[0], r), k = layout.shard(full[1], r),
             v = layout.shard(full[2], r);
      const std::vector<int64_t> pos = layout.token_positions(r);
      const int64_t tl = pos.size();
      Tensor o(DType::f32, {1, tl, kHq, kD}), lse(DType::f32, {1, kHq, tl});
      Tensor dq(DType::f32, {1, tl, kHq, kD}), dk(DType::f32, {1, tl, kHq, kD});
      Tensor dv(DType::f32, {1, tl, kHq, kD});
      s->forward(q, k, v, Tokens{pos, {}}, o, lse);
      s->backward(q, k, v, Tokens{pos, {}}, o, lse, o, dq, dk, dv);
    });
    for (int r = 0; r < kRanks; ++r)
      EXPECT_EQ(errors[r], "") << strategy_name(kind) << " rank " << r;
  }
}

}  // namespace
}  // namespace ctxpar::testing
