// Note [The ranks agree on bf16 products] (src/kernel/problem.h): the ranks of a strategy agree
// on the lowest bf16-products level any of them takes, and that strategy keeps it in its own
// options. An agreement that lowered the level once lowered it for the whole process: every
// strategy made after it, on any communicator, computed with the lower level (other bits).
#include <gtest/gtest.h>

#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "kernel/amx_forced.h"
#include "strategy/strategy_support.h"
#include "same_bits.h"

namespace ctxpar::testing {
namespace {

TEST(Bf16Agreement, AnAgreementOnOneCommunicatorLeavesTheNextStrategysBitsAlone) {
  const test::TopProducts levels = test::top_products();
  if (!levels.skip.empty()) GTEST_SKIP() << levels.skip;
  const Bf16Products high = levels.high, low = levels.low;
  Problem pr;
  pr.tokens = 160, pr.hq = pr.hkv = 2, pr.d = 32, pr.dtype = DType::bf16;
  pr.mask = Mask::causal_mask();
  pr.build();
  StrategyOptions opt;
  opt.mask = pr.mask;
  opt.kernel.bf16_products = high;
  const RunResult before = run_sharded(pr, 2, LayoutKind::zigzag, opt);

  // Another strategy, on another communicator, whose ranks disagree: rank 1 takes the level
  // below. They agree on it, and it is that strategy's.
  std::vector<Bf16Products> agreed(2);
  const std::vector<std::string> errors = errors_on_ranks(2, [&](Communicator& comm) {
    StrategyOptions mixed = opt;
    if (comm.rank() == 1) mixed.kernel.bf16_products = low;
    agreed[comm.rank()] = Strategy::create(comm, mixed)->options().kernel.bf16_products;
  });
  EXPECT_EQ(errors, std::vector<std::string>(2));
  EXPECT_EQ(agreed, std::vector<Bf16Products>(2, low));

  const RunResult after = run_sharded(pr, 2, LayoutKind::zigzag, opt);
  opt.kernel.bf16_products = low;
  const RunResult lower = run_sharded(pr, 2, LayoutKind::zigzag, opt);
  bool all_same_as_lower = true;
  for (auto [a, b, l, what] : {std::tuple{&after.o, &before.o, &lower.o, "o"},
                               {&after.lse, &before.lse, &lower.lse, "lse"},
                               {&after.dq, &before.dq, &lower.dq, "dq"},
                               {&after.dk, &before.dk, &lower.dk, "dk"},
                               {&after.dv, &before.dv, &lower.dv, "dv"}}) {
    EXPECT_TRUE(test::same_bits(*a, *b)) << what << ": a later strategy's bits changed";
    all_same_as_lower = all_same_as_lower && test::same_bits(*l, *b);
  }
  // The two levels give other bits on these inputs, so the comparison above can fail.
  EXPECT_FALSE(all_same_as_lower) << bf16_products_name(high) << " and " << bf16_products_name(low);
}

}  // namespace
}  // namespace ctxpar::testing
