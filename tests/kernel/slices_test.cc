// Slice masks (mask_rules.h's MaskSlice: any block mask as a union of full / bottom-right causal
// slices): the rule against a hand-written matrix, the tile classification against brute force,
// and the kernel's forward and backward against the fp64 reference (whose slice rule is written
// independently, reference.cc), on prefix trees, sinks, overlapping random slices, striped and
// unsorted positions, K/V in blocks and two threads.
// Tolerance rule (kernel_support.h): max|fast - ref64| <= 2 max|naive32 - ref64| + floor.
#include <gtest/gtest.h>

#include <random>

#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

Mask sliced(std::vector<MaskSlice> s, bool causal = false) {
  Mask m;
  m.causal = causal;
  m.set_slices(std::move(s));
  return m;
}

// Random slices inside [0, t): overlapping, full and causal, unequal sides.
std::vector<MaskSlice> random_slices(int64_t t, int n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  auto range = [&](int64_t& lo, int64_t& hi) {
    lo = int64_t(rng() % uint64_t(t));
    hi = lo + 1 + int64_t(rng() % uint64_t(t - lo));
  };
  std::vector<MaskSlice> out(static_cast<size_t>(n));
  for (MaskSlice& s : out) {
    range(s.q_lo, s.q_hi), range(s.k_lo, s.k_hi);
    s.causal = int32_t(rng() % 2);
  }
  return out;
}

TEST(Slices, BottomRightCausalAsFlashAttentionAligns) {
  // q [10, 14) x k [0, 8) causal: the last query sees every key, each earlier one one fewer.
  const Mask m = sliced({{10, 14, 0, 8, 1}});
  const char* want[] = {"11111000", "11111100", "11111110", "11111111"};
  for (int64_t q = 10; q < 14; ++q)
    for (int64_t k = 0; k < 8; ++k)
      EXPECT_EQ(m.visible(q, k), want[q - 10][k] == '1') << "q " << q << " k " << k;
  EXPECT_FALSE(m.visible(9, 0));   // outside the slice's queries
  EXPECT_FALSE(m.visible(10, 8));  // outside its keys
  // More queries than keys: the first queries see nothing.
  const Mask tall = sliced({{0, 6, 0, 2, 1}});
  for (int64_t q = 0; q < 6; ++q) EXPECT_EQ(tall.visible(q, 0), q >= 4) << q;
}

TEST(Slices, TileClassificationIsSound) {
  // skip: no pair visible; full: every pair visible (brute force over the rectangle).
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const Mask m = sliced(random_slices(40, 1 + int(rng() % 4), rng()), rng() % 3 == 0);
    TileRange q, k;
    q.pos_lo = int64_t(rng() % 40), q.pos_hi = q.pos_lo + int64_t(rng() % 8);
    k.pos_lo = int64_t(rng() % 40), k.pos_hi = k.pos_lo + int64_t(rng() % 8);
    int seen = 0, total = 0;
    for (int64_t a = q.pos_lo; a <= q.pos_hi; ++a)
      for (int64_t b = k.pos_lo; b <= k.pos_hi; ++b) seen += m.visible(a, b), ++total;
    const TileKind kind = classify(m, q, k);
    if (kind == TileKind::skip) {
      EXPECT_EQ(seen, 0) << m.describe();
    }
    if (kind == TileKind::full) {
      EXPECT_EQ(seen, total) << m.describe();
    }
    if (seen == 0) {
      EXPECT_NE(kind, TileKind::full);
    }
  }
}

TEST(Slices, KernelMatchesReference) {
  std::vector<Case> cases;
  auto add = [&](int64_t tq, int64_t tk, Mask m) {
    Case c;
    c.tq = tq, c.tk = tk, c.hq = 2, c.hkv = 1, c.d = 32, c.mask = std::move(m);
    cases.push_back(c);
    return &cases.back();
  };
  add(200, 200, sliced(prefix_tree_slices(80, {40, 50, 30})));  // a prompt and three responses
  // Attention sinks: the first 4 tokens seen by all, plus a causal window of 32 as slices.
  std::vector<MaskSlice> sink{{0, 150, 0, 4, 0}};
  for (int64_t s = 0; s < 150; s += 32)
    sink.push_back({s, std::min<int64_t>(s + 32, 150), s > 32 ? s - 32 : 0,
                    std::min<int64_t>(s + 32, 150), 1});
  add(150, 150, sliced(sink));
  add(130, 90, sliced(random_slices(130, 6, 3)));
  add(97, 97, sliced(random_slices(97, 3, 4), true));  // AND with the causal rule
  Case* striped = add(120, 120, sliced(random_slices(240, 5, 5)));
  striped->q_stride = striped->k_stride = 2, striped->k_offset = 1;
  Case* shuffled = add(100, 100, sliced(prefix_tree_slices(30, {20, 25, 25})));
  shuffled->shuffle = true;
  Case* threads = add(190, 190, sliced(random_slices(190, 8, 6)));
  threads->threads = 2, threads->dtype = DType::bf16;
  // Key tile 3 shown to query tiles 0 and 2 but not 1: a task of 4 query tiles (fp32 and the
  // exact bf16 tier through AMX, Note [Two query tiles a task]) has a skipped tile between two
  // computed ones, whose rows must see nothing of it.
  Case* gap =
      add(256, 256, sliced({{0, 256, 0, 192, 0}, {0, 64, 192, 256, 0}, {128, 192, 192, 256, 0}}));
  gap->dtype = DType::bf16;
  add(256, 256, gap->mask);  // the same in fp32 (4 query tiles a task too)
  for (const Case& c : cases) {
    const std::string err = check_case(c, true);
    EXPECT_TRUE(err.empty()) << c.mask.describe() << ": " << err;
  }
}

TEST(Slices, BlocksInAnyOrderMatchOneCall) {
  Case c;
  c.tq = 160, c.tk = 160, c.hq = 2, c.hkv = 2, c.d = 16;
  c.mask = sliced(prefix_tree_slices(64, {32, 32, 32}));
  const Inputs in = make_inputs(c);
  const References refs = references_of(in, c.mask, true);
  const Outputs out = run_fast(in, c.mask, 1, true, 3, {2, 0, 1});
  EXPECT_EQ(rule_violations(out, refs, true), "");
}

TEST(Slices, SparseMasksSkipTheirInvisibleTiles) {
  // A prefix tree of 64-token parts: of the 4 x 4 tiles the prompt computes its own (causal),
  // each response the prompt's and its own; the other 9 show nothing and are skipped.
  Case c;
  c.tq = 256, c.tk = 256, c.hq = 1, c.hkv = 1, c.d = 16;
  c.mask = sliced(prefix_tree_slices(64, {64, 64, 64}));
  const Inputs in = make_inputs(c);
  const Outputs out = run_fast(in, c.mask, 1, false);
  EXPECT_EQ(out.fwd.tiles_skipped, 9);
  EXPECT_EQ(out.fwd.tiles_computed, 7);
}

}  // namespace
}  // namespace ctxpar::test
