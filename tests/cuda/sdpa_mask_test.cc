// A fused call as cuDNN's mask attributes (src/cuda/sdpa_mask.h): under cuDNN's documented
// index rules the attributes show exactly the pairs Call::visible shows, for every call the
// decomposition makes over every layout x P = 2..4 x mask (documents included).
#include <gtest/gtest.h>

#include <set>
#include <string>
#include <vector>

#include "ctxpar/layout.h"
#include "ctxpar/mask.h"
#include "cuda/sdpa_mask.h"

namespace ctxpar {
namespace {

TEST(CudaSdpaMask, AttributesShowExactlyTheCallsPairs) {
  const char* masks[] = {
      "none",       "causal",      "window:5,0",       "causal+window:7,0",   "window:6,3",
      "window:0,4", "window:4,-1", "causal+documents", "window:3,2+documents"};
  std::set<std::string> forms;
  int calls = 0;
  for (LayoutKind kind : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped})
    for (int p = 2; p <= 4; ++p) {
      const int64_t t = layout_granule(kind, p) * 3;
      std::vector<int32_t> docs(t);
      for (int64_t i = 0; i < t; ++i) docs[i] = int32_t(i / 7);
      const Layout layout(kind, t, p);
      for (const char* m : masks) {
        const Mask mask = parse_mask(m);
        for (int rq = 0; rq < p; ++rq)
          for (int rk = 0; rk < p; ++rk) {
            const std::vector<int64_t> qp = layout.token_positions(rq, {}),
                                       kp = layout.token_positions(rk, {});
            const std::vector<int32_t> qd = layout.shard(docs, rq, int32_t{-1}),
                                       kd = layout.shard(docs, rk, int32_t{-1});
            for (const fused::Call& c : fused::decompose({qp, qd}, {kp, kd}, mask)) {
              const cuda::SdpaMask s = cuda::sdpa_mask_of(c);
              forms.insert(s.describe().substr(0, s.describe().find(' ')) +
                           (s.has_left ? " band" : ""));
              ++calls;
              for (int64_t i = 0; i < c.rows(); ++i)
                for (int64_t j = 0; j < c.keys(); ++j)
                  ASSERT_EQ(s.visible(i, j, c.rows(), c.keys()), c.visible(i, j))
                      << layout_name(kind) << " P=" << p << " " << m << " call " << c.describe()
                      << " as " << s.describe() << " at (" << i << ", " << j << ")";
            }
          }
      }
    }
  EXPECT_GT(calls, 900);
  // Every form occurs: no mask, a top-left or bottom-right diagonal, bands.
  EXPECT_EQ(forms, (std::set<std::string>{"no", "TOP_LEFT", "BOTTOM_RIGHT", "TOP_LEFT band"}));
}

}  // namespace
}  // namespace ctxpar
