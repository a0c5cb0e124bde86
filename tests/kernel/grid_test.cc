// Forward and backward against the fp64 reference over a grid that covers each axis
// (lengths 1/7/63/65/1000, D 16/64/80/128/256, GQA 1/4/8, every mask kind and combination,
// Tq != Tk, offset / strided / unsorted positions, fp32 and bf16, 1 and 2 threads) with a few
// combinations each rather than the full cross product, so the binary stays fast.
// Tolerance rule (kernel_support.h): max|fast - ref64| <= 2 max|naive32 - ref64| + floor.
#include <gtest/gtest.h>

#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

Mask documents(bool causal) {
  Mask m;
  m.documents = true, m.causal = causal;
  return m;
}

void run_all(const std::vector<Case>& cases, bool backward = true) {
  for (const Case& c : cases) {
    const std::string err = check_case(c, backward);
    EXPECT_TRUE(err.empty()) << err;
  }
}

Case make(int64_t tq, int64_t tk, int64_t hq, int64_t hkv, int64_t d, Mask m = {},
          DType t = DType::f32) {
  Case c;
  c.tq = tq, c.tk = tk, c.hq = hq, c.hkv = hkv, c.d = d, c.mask = m, c.dtype = t;
  return c;
}

TEST(Grid, Lengths) {
  std::vector<Case> cases;
  for (int64_t t : {1, 7, 63, 65}) cases.push_back(make(t, t, 2, 1, 64, Mask::causal_mask()));
  cases.push_back(make(1, 65, 1, 1, 16));
  cases.push_back(make(65, 1, 1, 1, 16));
  cases.push_back(make(1000, 1000, 1, 1, 16, Mask::causal_mask()));
  run_all(cases);
}

TEST(Grid, HeadDims) {
  std::vector<Case> cases;
  for (int64_t d : {16, 64, 80, 128, 256})
    cases.push_back(make(65, 63, 1, 1, d, Mask::causal_mask()));
  cases.push_back(make(130, 130, 1, 1, 256, window(40, 10), DType::bf16));
  // Head dims that are not a multiple of the vector width (zero padding in the packed tiles).
  cases.push_back(make(70, 67, 2, 1, 20, Mask::causal_mask()));
  cases.push_back(make(33, 90, 1, 1, 100, window(30, 30), DType::bf16));
  run_all(cases);
}

TEST(Grid, GroupedQueryHeads) {
  std::vector<Case> cases;
  cases.push_back(make(63, 70, 4, 4, 64, Mask::causal_mask()));  // GQA ratio 1
  cases.push_back(make(63, 70, 4, 1, 80, {}, DType::bf16));      // ratio 4
  cases.push_back(make(65, 65, 8, 1, 16, Mask::causal_mask()));  // ratio 8 (MQA)
  cases.push_back(make(40, 33, 8, 2, 32, window(7, 7)));         // ratio 4, two kv heads
  Case b = make(30, 45, 4, 2, 16, Mask::causal_mask());
  b.batch = 3;
  cases.push_back(b);
  run_all(cases);
}

TEST(Grid, MaskKindsAndCombinations) {
  std::vector<Case> cases;
  const Mask masks[] = {Mask{},
                        Mask::causal_mask(),
                        window(20, 0),
                        window(9, 13),
                        window(-1, 5),
                        window(17, -1, true),
                        documents(false),
                        documents(true),
                        window(25, 3, false, true),
                        window(30, 0, true, true)};
  int i = 0;
  for (const Mask& m : masks) {
    Case c = make(130, 130, 2, 1, 32, m, i % 2 ? DType::bf16 : DType::f32);
    c.doc_len = 37;
    c.seed = 10 + i++;
    cases.push_back(c);
  }
  run_all(cases);
}

TEST(Grid, PositionsWithOffsetsStridesAndShuffles) {
  std::vector<Case> cases;
  // A later query block against an earlier key block (ring step): Tq != Tk, all visible.
  Case c = make(65, 130, 2, 2, 64, Mask::causal_mask());
  c.q_offset = 200;
  cases.push_back(c);
  // Striped layout with 4 ranks: query rank 1, key rank 3 (stride 4).
  c = make(70, 70, 2, 1, 64, Mask::causal_mask(), DType::bf16);
  c.q_offset = 1, c.q_stride = 4, c.k_offset = 3, c.k_stride = 4;
  cases.push_back(c);
  // Key block partly ahead of the queries, sliding window with documents.
  c = make(100, 77, 2, 2, 48, window(60, 0, true, true));
  c.q_offset = 50, c.k_offset = 90, c.k_stride = 2, c.doc_len = 64;
  cases.push_back(c);
  // Unsorted positions (Ulysses after zigzag): tile ranges must use min / max.
  c = make(150, 150, 2, 1, 32, Mask::causal_mask());
  c.shuffle = true;
  cases.push_back(c);
  c = make(150, 150, 1, 1, 16, window(20, 20, false, true));
  c.shuffle = true, c.doc_len = 50, c.dtype = DType::bf16;
  cases.push_back(c);
  run_all(cases);
}

TEST(Grid, TwoThreads) {
  std::vector<Case> cases;
  Case c = make(130, 97, 4, 2, 64, Mask::causal_mask());
  c.threads = 2, c.q_offset = 40;
  cases.push_back(c);
  c = make(65, 65, 1, 1, 128, documents(true), DType::bf16);  // fewer tasks than threads
  c.threads = 2, c.doc_len = 20;
  cases.push_back(c);
  run_all(cases);
}

TEST(Grid, LongSequence) {
  Case c = make(1000, 1000, 2, 1, 64, window(300, 0, true), DType::bf16);
  c.threads = 2;
  run_all({c});
}

}  // namespace
}  // namespace ctxpar::test
