// Load balance of the ring under a causal mask (docs/ring.md, "Note [load balance for causal
// masks]"): the FLOPs each rank's kernel actually computed. Contiguous: rank P-1 does
// (P - 1/2) / (P/2) of the mean (1.875 for P = 8); zigzag and striped: the mean, to within the
// diagonal. Fully masked blocks cost nothing, so contiguous's total is about half the
// unmasked FLOPs.
#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

TEST(Balance, RingCausalFlopsPerRank) {
  const int p = 8;
  Problem pr;
  pr.tokens = 1024;  // chunks of T/2P = 64 tokens: whole kernel tiles
  pr.hq = 1;
  pr.hkv = 1;
  pr.mask = Mask::causal_mask();
  pr.build();
  StrategyOptions opt;
  opt.mask = pr.mask;
  const double full = attention_flops(1, 1, pr.tokens, pr.tokens, pr.d);
  auto ratio = [&](LayoutKind lk, double* total) {
    RunResult res = run_sharded(pr, p, lk, opt, false);
    std::vector<double> f;
    for (const StrategyStats& s : res.forward_stats) f.push_back(s.attention_flops);
    *total = std::accumulate(f.begin(), f.end(), 0.0);
    return *std::max_element(f.begin(), f.end()) / (*total / p);
  };
  double total = 0;
  const double contiguous = ratio(LayoutKind::contiguous, &total);
  EXPECT_GT(contiguous, 1.7);
  EXPECT_LT(contiguous, 1.95);
  EXPECT_LT(total, 0.6 * full) << "fully masked blocks must be skipped";
  const double zigzag = ratio(LayoutKind::zigzag, &total);
  EXPECT_LE(zigzag, 1.05);
  EXPECT_LT(total, 0.6 * full);
  const double striped = ratio(LayoutKind::striped, &total);
  EXPECT_LE(striped, 1.05);
}

}  // namespace
}  // namespace ctxpar::testing
