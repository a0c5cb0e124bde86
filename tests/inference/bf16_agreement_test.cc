// Note [The ranks agree on bf16 products] (src/kernel/problem.h), for KV caches: the ranks of a
// cache agree at its first prefill on the lowest bf16-products level any of them takes, and
// that cache keeps it in its own options; a cache made afterwards, on another communicator,
// computes with its own ranks' level.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "inference/inference_support.h"
#include "kernel/amx_forced.h"
#include "same_bits.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

// Every rank's output and LSE of every sequence equal, bitwise.
bool same_results(const std::vector<RankResult>& x, const std::vector<RankResult>& y) {
  for (size_t r = 0; r < x.size(); ++r)
    for (size_t b = 0; b < x[r].out.size(); ++b)
      if (!test::same_bits(x[r].out[b], y[r].out[b]) || !test::same_bits(x[r].lse[b], y[r].lse[b]))
        return false;
  return true;
}

Scenario bf16_scenario(Bf16Products products) {
  Scenario s;
  s.dtype = DType::bf16;
  s.prefill = {90, 41};
  s.chunk = 40;
  s.bf16_products = products;
  s.build();
  return s;
}

TEST(Bf16Agreement, ACachesAgreementLeavesTheNextCachesBitsAlone) {
  const test::TopProducts levels = test::top_products();
  if (!levels.skip.empty()) GTEST_SKIP() << levels.skip;
  const Bf16Products high = levels.high, low = levels.low;
  const std::vector<RankResult> before = run_on_threads(bf16_scenario(high), 2);

  // Another cache, on another communicator, whose ranks disagree: rank 1 takes the level
  // below. They agree on it, and it is that cache's.
  std::vector<Bf16Products> agreed(2);
  run_threads(2, [&](Communicator& comm) {
    const Scenario mine = bf16_scenario(comm.rank() == 1 ? low : high);
    agreed[comm.rank()] = run_rank(comm, mine).bf16_products;
  });
  EXPECT_EQ(agreed, std::vector<Bf16Products>(2, low));

  const std::vector<RankResult> after = run_on_threads(bf16_scenario(high), 2);
  EXPECT_TRUE(same_results(after, before)) << "a later cache's bits changed";
  // The two levels give other bits on these inputs, so the comparison above can fail.
  EXPECT_FALSE(same_results(run_on_threads(bf16_scenario(low), 2), before))
      << bf16_products_name(high) << " and " << bf16_products_name(low);
}

}  // namespace
