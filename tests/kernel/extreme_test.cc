// Inputs at the edges of fp32 and int64, against the fp64 reference with the kernel rule
// (kernel_support.h): max|fast - ref64| <= 2 max|naive32 - ref64| + 1e-5 max(1, |ref64|).
//  - Logits spread to |s| ~ 1e4 .. 5e8 (q, k scaled; the softmax is one-hot) or offset by
//    1e4 .. 1e6 (a common component in q and k): the backward recomputes P = exp(S - LSE) from
//    the forward's LSE, so S must be rounded exactly as the forward rounded it and P can never
//    exceed 1 (issue 9: dq was 3.9e7 where the truth is 0, dv many times the naive error).
//    See docs/kernel.md, Note [P at most one].
#include <gtest/gtest.h>

#include <cmath>

#include "kernel/kernel_support.h"

namespace ctxpar::test {
namespace {

Case logits(float qk_scale, int64_t d, Mask mask, DType dtype = DType::f32) {
  Case c;
  c.tq = 70, c.tk = 130, c.hq = 2, c.hkv = 1, c.d = d, c.mask = mask, c.dtype = dtype;
  c.k_offset = 0, c.q_offset = 60;
  c.qk_scale = qk_scale;
  return c;
}

// Spread: |s| ~ qk_scale^2 (unit normal q, k times qk_scale; scale 1/sqrt(D)).
TEST(ExtremeLogits, LargeLogitsBackwardWithinTheRule) {
  for (float qk : {100.0f, 1000.0f})  // |s| ~ 1e4, 1e6
    for (int64_t d : {16, 64, 80})
      for (Mask m : {Mask::none(), Mask::causal_mask()}) {
        const std::string err = check_case(logits(qk, d, m), true);
        EXPECT_TRUE(err.empty()) << err;
      }
}

// Offset: every logit ~ common^2 + N(0, 1), so the softmax is not one-hot and the naive fp32
// error is large; the rounding of S against LSE is what separates the fast path from it.
TEST(ExtremeLogits, OffsetLogitsBackwardWithinTheRule) {
  for (float common : {100.0f, 300.0f, 1000.0f})  // offsets 1e4, 9e4, 1e6
    for (int64_t d : {16, 64, 80})
      for (Mask m : {Mask::none(), Mask::causal_mask()}) {
        Case c = logits(1, d, m);
        c.qk_common = common * std::sqrt(std::sqrt(float(d)));
        const std::string err = check_case(c, true);
        EXPECT_TRUE(err.empty()) << err;
      }
}

TEST(ExtremeLogits, HugeLogitsGivePAtMostOne) {
  // |s| ~ 5e8: the fp32 ulp of a score is 32 or more, so any difference between the forward's
  // and the backward's rounding of S used to give P = 2^(tens), dq ~ 1e7. Softmax is one-hot
  // here: the truth is dq = dk = 0, dv = the dO of the query rows whose argmax is that key.
  for (int64_t d : {16, 64})
    for (Mask m : {Mask::none(), Mask::causal_mask()}) {
      const std::string err = check_case(logits(22360.0f, d, m), true);
      EXPECT_TRUE(err.empty()) << err;
    }
}

}  // namespace
}  // namespace ctxpar::test
