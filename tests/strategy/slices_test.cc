// Slice masks and the balanced layout through every strategy: a prefix tree, random overlapping
// slices under the causal rule, and packed documents, sharded by the balanced layout (and by
// the fixed layouts, for the slices), forward and backward against the fp64 reference of the
// unpadded problem. Tolerance: the project's rule (2 x naive fp32's error + floor).
#include <gtest/gtest.h>

#include <random>

#include "strategy/strategy_support.h"

namespace ctxpar::testing {
namespace {

Mask with_slices(std::vector<MaskSlice> s, bool causal) {
  Mask m;
  m.causal = causal;
  m.set_slices(std::move(s));
  return m;
}

TEST(Slices, EveryStrategyAndLayoutMatchesReference) {
  std::vector<Mask> masks;
  masks.push_back(with_slices(prefix_tree_slices(17, {9, 11, 8}), false));  // T = 45
  std::mt19937_64 rng(11);
  std::vector<MaskSlice> random;
  for (int i = 0; i < 5; ++i) {
    MaskSlice s;
    s.q_lo = int64_t(rng() % 40), s.q_hi = s.q_lo + 1 + int64_t(rng() % (45 - s.q_lo));
    s.k_lo = int64_t(rng() % 40), s.k_hi = s.k_lo + 1 + int64_t(rng() % (45 - s.k_lo));
    s.causal = int32_t(i % 2);
    random.push_back(s);
  }
  masks.push_back(with_slices(random, true));
  masks.push_back(parse_mask("causal+documents"));
  int runs = 0;
  for (size_t mi = 0; mi < masks.size(); ++mi) {
    Problem pr;
    pr.tokens = 45, pr.hq = 4, pr.hkv = 2, pr.mask = masks[mi], pr.seed = 70 + mi;
    pr.build();
    const References& refs = references_of(pr);
    const Errors bound = bounds_of(refs);
    for (StrategyKind kind :
         {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid})
      for (int p : {2, 4})
        for (LayoutKind lk : {LayoutKind::balanced, LayoutKind::contiguous, LayoutKind::striped}) {
          StrategyOptions opt;
          opt.kind = kind;
          opt.mask = pr.mask;
          opt.ulysses_degree = kind == StrategyKind::hybrid ? 2 : 0;
          const Errors e = errors_of(run_sharded(pr, p, lk, opt), refs);
          ++runs;
          const std::string where = std::string(strategy_name(kind)) +
                                    " mask=" + pr.mask.describe() + " P=" + std::to_string(p) +
                                    " layout=" + layout_name(lk);
          EXPECT_LE(e.o, bound.o) << where;
          EXPECT_LE(e.lse, bound.lse) << where;
          EXPECT_LE(e.dq, bound.dq) << where;
          EXPECT_LE(e.dk, bound.dk) << where;
          EXPECT_LE(e.dv, bound.dv) << where;
        }
  }
  EXPECT_EQ(runs, 3 * 4 * 2 * 3);
}

// Ranks whose slice lists differ (same count, one bound off) are refused on every rank naming
// the mask: its description carries a hash of the list, which the ranks agree.
TEST(Slices, RanksWithOtherSlicesAreRefused) {
  const std::vector<std::string> errors = errors_on_ranks(2, [&](Communicator& comm) {
    StrategyOptions opt;
    opt.mask = with_slices({{0, 8, 0, 8, 1}, {8, 16, 0, comm.rank() == 0 ? 4 : 5, 0}}, false);
    Strategy::create(comm, opt);
  });
  for (const std::string& e : errors) EXPECT_NE(e.find("mask"), std::string::npos) << e;
}

}  // namespace
}  // namespace ctxpar::testing
