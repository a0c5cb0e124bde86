#include "ctxpar/mask.h"

#include <gtest/gtest.h>

#include <algorithm>

#include "ctxpar/error.h"

namespace ctxpar {
namespace {

TEST(Mask, Parse) {
  EXPECT_FALSE(parse_mask("none").any());
  EXPECT_TRUE(parse_mask("causal").causal);
  Mask w = parse_mask("causal+window:128,0");
  EXPECT_TRUE(w.causal);
  EXPECT_EQ(w.window_left, 128);
  EXPECT_EQ(w.window_right, 0);
  EXPECT_TRUE(parse_mask("documents:3,5").documents);
  EXPECT_EQ(parse_mask("causal+documents").describe(), "causal+documents");
  EXPECT_THROW(parse_mask("casual"), Error);
  EXPECT_THROW(parse_mask("window:12"), Error);
  EXPECT_THROW(parse_mask("window:a,b"), Error);
}

TEST(Mask, VisibleRules) {
  Mask c = Mask::causal_mask();
  EXPECT_TRUE(c.visible(5, 5));
  EXPECT_TRUE(c.visible(5, 0));
  EXPECT_FALSE(c.visible(5, 6));
  Mask w = parse_mask("window:2,1");
  EXPECT_TRUE(w.visible(10, 8));
  EXPECT_FALSE(w.visible(10, 7));
  EXPECT_TRUE(w.visible(10, 11));
  EXPECT_FALSE(w.visible(10, 12));
  Mask d = parse_mask("documents");
  EXPECT_TRUE(d.visible(0, 100, 3, 3));
  EXPECT_FALSE(d.visible(0, 1, 3, 4));
}

// Tile verdicts must agree with the element rule by brute force: a "masked" tile has no visible
// pair, a "full" tile has no hidden pair. (Independent check of the skip logic the kernel uses.)
TEST(Mask, TileVerdictsAgreeWithElements) {
  const Mask masks[] = {parse_mask("none"), parse_mask("causal"), parse_mask("window:3,2"),
                        parse_mask("causal+window:4,0"), parse_mask("documents"),
                        parse_mask("causal+documents")};
  int checked = 0;
  for (const Mask& m : masks)
    for (int qlo = 0; qlo < 12; qlo += 3)
      for (int qn = 1; qn <= 4; ++qn)
        for (int klo = 0; klo < 12; klo += 2)
          for (int kn = 1; kn <= 4; ++kn)
            for (int doc_split = 0; doc_split < 3; ++doc_split) {
              // document id of a position: changes at position 6 (split 1) or never (0, 2).
              auto doc = [&](int p) { return doc_split == 1 ? (p >= 6 ? 1 : 0) : doc_split; };
              int qhi = qlo + qn - 1, khi = klo + kn - 1;
              bool any = false, all = true;
              for (int q = qlo; q <= qhi; ++q)
                for (int k = klo; k <= khi; ++k) {
                  bool v = m.visible(q, k, doc(q), doc(k));
                  any |= v;
                  all &= v;
                }
              if (m.tile_masked(qlo, qhi, klo, khi, doc(qlo), doc(qhi), doc(klo), doc(khi)))
                EXPECT_FALSE(any) << m.describe() << " q[" << qlo << "," << qhi << "] k[" << klo
                                  << "," << khi << "]";
              if (m.tile_full(qlo, qhi, klo, khi, doc(qlo), doc(qhi), doc(klo), doc(khi)))
                EXPECT_TRUE(all) << m.describe();
              ++checked;
            }
  EXPECT_GT(checked, 1000);
}

}  // namespace
}  // namespace ctxpar
