// Inputs at the edges of fp32 and int64, against the fp64 reference with the kernel rule
// (kernel_support.h): max|fast - ref64| <= 2 max|naive32 - ref64| + 1e-5 max(1, |ref64|).
//  - Logits spread to |s| ~ 1e4 .. 5e8 (q, k scaled; the softmax is one-hot) or offset by
//    1e4 .. 1e6 (a common component in q and k): the backward recomputes P = exp(S - LSE) from
//    the forward's LSE, so S must be rounded exactly as the forward rounded it and P can never
//    exceed 1 (dq was once 3.9e7 where the truth is 0, dv many times the naive error).
//    See docs/kernel.md, Note [P at most one].
//  - Positions anywhere in int64 (INT64_MIN itself marks padding), near INT64_MAX / INT64_MIN and +-2^62 on both sides, with
//    windows up to INT64_MAX: the mask arithmetic must not overflow (an overflow made every
//    row come out zero). The reference decides visibility in 128-bit arithmetic, independently.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <vector>

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

// Logits rising along the keys (Note [A row's base], simd_tile.h): a row's max grows at every
// key step, by a little (its base stays, P up to 2^8 against it) or by more than the slack
// (the base moves at many or every step, the step done again from its kept scores), one key
// tile a step (fp32) and four (bf16 through AMX), under no mask and causal, 1 and 2 threads.
// O and the LSE within the rule; a wrong base, a lost rescale or a P outgrowing fp32 would not
// be. The backward too where K stays moderate: with K ~ 900 (rise 1.5) its dq error is
// |K| times that of delta = rowsum(dO O), 2.25 x the naive one with the max-first softmax
// already (within the rule only by its floor), so that case checks the forward alone.
TEST(ExtremeLogits, RisingLogitsMoveTheBaseWithinTheRule) {
  for (DType dtype : {DType::f32, DType::bf16})
    for (float rise : {0.002f, 0.02f, 0.3f, 1.5f})  // logits up 0.016 / 0.16 / 2.4 / 12 a key tile
      for (Mask m : {Mask::none(), Mask::causal_mask()})
        for (int threads : {1, 2}) {
          Case c = logits(1, 64, m, dtype);
          c.tk = 600, c.q_offset = 530, c.k_rise = rise, c.threads = threads;
          const std::string err = check_case(c, rise < 1.0f);
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

// A score beyond fp32 from finite inputs (q . k = 1.6e41 for query 5, key 2): the row came
// out with LSE = -inf and O = 0, exactly as a row with no visible key; now its LSE is +inf (the
// strategies fail on it, naming the row). A fully masked row (padding) keeps -inf and 0, and
// the other rows are untouched.
TEST(ExtremeLogits, ScoreBeyondFp32GivesPlusInfLseNotAMaskedRow) {
  const int64_t t = 8, d = 16;
  Tensor q(DType::f32, {1, t, 1, d}), k(DType::f32, {1, t, 1, d}), v(DType::f32, {1, t, 1, d});
  fill_normal(q, 1), fill_normal(k, 2), fill_normal(v, 3);
  for (int64_t i = 0; i < d; ++i) {
    q.ptr<float>()[q.view().offset(0, 5, 0, i)] = 1e20f;
    k.ptr<float>()[k.view().offset(0, 2, 0, i)] = 1e20f;
  }
  std::vector<int64_t> pos = {0, 1, 2, 3, 4, 5, 6, kPaddingPosition};
  const Tokens tokens{pos, {}};
  ForwardState state(1, t, 1, d);
  Tensor out(DType::f32, {1, t, 1, d}), lse(DType::f32, {1, 1, t});
  attention_forward_block(q, tokens, k, v, tokens, Mask::causal_mask(), state, {});
  attention_forward_finalize(state, out, lse, {});
  const float* l = lse.ptr<const float>();
  EXPECT_EQ(l[5], std::numeric_limits<float>::infinity());
  EXPECT_EQ(l[7], -std::numeric_limits<float>::infinity()) << "padding: no visible key";
  for (int64_t i = 0; i < d; ++i) EXPECT_EQ(out.view().get(0, 7, 0, i), 0.0f);
  for (int64_t r : {0, 1, 6}) EXPECT_TRUE(std::isfinite(l[r])) << r;
}

constexpr int64_t kMax = std::numeric_limits<int64_t>::max();
// The smallest position a real token may have: INT64_MIN itself marks padding (kPaddingPosition,
// mask.h), which no query sees and which sees nothing.
constexpr int64_t kMin = std::numeric_limits<int64_t>::min() + 1;
static_assert(kMin - 1 == kPaddingPosition);

Case positions(int64_t q_offset, int64_t q_stride, int64_t k_offset, int64_t k_stride, Mask m) {
  Case c;
  c.tq = 70, c.tk = 130, c.hq = 2, c.hkv = 1, c.d = 16, c.mask = m;
  c.q_offset = q_offset, c.q_stride = q_stride, c.k_offset = k_offset, c.k_stride = k_stride;
  return c;
}

TEST(ExtremePositions, WholeInt64RangeWithWindows) {
  const std::vector<Mask> masks = {Mask::causal_mask(),        window(20, 0, true),
                                   window(30, 30, false),      window(kMax, 0, false),
                                   window(0, kMax, false),     window(kMax, kMax, true),
                                   window(1LL << 62, 5, false)};
  std::vector<Case> cases;
  for (const Mask& m : masks) {
    cases.push_back(positions(kMax - 100, 1, kMax - 150, 1, m));   // near INT64_MAX
    cases.push_back(positions(kMin + 40, 1, kMin, 1, m));          // near INT64_MIN
    cases.push_back(positions(1LL << 62, 1, -(1LL << 62), 1, m));  // +-2^62: distance 2^63
    cases.push_back(positions(-(1LL << 62), 1, 1LL << 62, 1, m));
    cases.push_back(positions(kMin, 1LL << 57, kMin + 5, 1LL << 57, m));  // spans the range
    Case shuffled = positions(kMax - 69, 1, kMin, (kMax / 129) * 2, m);
    shuffled.shuffle = true;  // unsorted: tiles' ranges from min / max of their positions
    cases.push_back(shuffled);
  }
  int64_t rows_seen = 0;
  for (const Case& c : cases) {
    const std::string err = check_case(c, true);
    EXPECT_TRUE(err.empty()) << err;
    const Inputs in = make_inputs(c);
    const auto ref =
        reference::attention_f64(in.q, in.q_tokens(), in.k, in.v, in.k_tokens(), c.mask);
    for (double l : ref.lse) rows_seen += std::isfinite(l);
  }
  EXPECT_GT(rows_seen, 0) << "the cases must not all be fully masked";
}

// The spanning case's positions wrap around int64 on purpose. They were computed as
// offset + stride * j in int64, whose overflow (2^57 x 64) is UB (UBSan: "signed integer
// overflow" in kernel_support.cc); now in uint64 and read back, the same positions as
// arithmetic modulo 2^64, written out here independently.
TEST(ExtremePositions, SpanningPositionsWrapModulo2To64) {
  const Inputs in = make_inputs(positions(kMin, 1LL << 57, kMin + 5, 1LL << 57, Mask::none()));
  ASSERT_EQ(in.q_pos.size(), 70u);
  ASSERT_EQ(in.k_pos.size(), 130u);
  EXPECT_EQ(in.q_pos[0], kMin);
  EXPECT_EQ(in.q_pos[63], kMin + 63 * (1LL << 57));  // = 2^63 - 2^57 + 1: no wrap yet
  EXPECT_EQ(in.q_pos[64], 1);                        // kMin + 2^63
  EXPECT_EQ(in.q_pos[69], 1 + 5 * (1LL << 57));
  EXPECT_EQ(in.k_pos[64], 6);  // kMin + 5 + 2^63
  EXPECT_EQ(in.k_pos[127], 6 + 63 * (1LL << 57));
  EXPECT_EQ(in.k_pos[128], kMin + 5);  // kMin + 5 + 2^64
  EXPECT_EQ(in.k_pos[129], kMin + 5 + (1LL << 57));
}

TEST(ExtremePositions, MaskRulesAgreeWithExactArithmetic) {
  const std::vector<int64_t> at = {kMin, kMin + 1, kMin + 2,  -(1LL << 62), -1,
                                   0,    1,        1LL << 62, kMax - 1,     kMax};
  const std::vector<int64_t> bounds = {-1, 0, 1, 1LL << 62, kMax};
  for (int64_t l : bounds)
    for (int64_t r : bounds)
      for (bool causal : {false, true}) {
        const Mask m = window(l, r, causal);
        for (int64_t q : at)
          for (int64_t k : at) {
            const __int128 diff = static_cast<__int128>(q) - k;
            const bool want =
                !(causal && diff < 0) && !(l >= 0 && diff > l) && !(r >= 0 && -diff > r);
            ASSERT_EQ(m.visible(q, k), want) << m.describe() << " q=" << q << " k=" << k;
            ASSERT_EQ(m.tile_masked(q, q, k, k), !want) << m.describe() << " q=" << q << " k=" << k;
            ASSERT_EQ(m.tile_full(q, q, k, k), want) << m.describe() << " q=" << q << " k=" << k;
          }
      }
}

}  // namespace
}  // namespace ctxpar::test
