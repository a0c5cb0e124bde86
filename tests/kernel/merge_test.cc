// merge() on its own: against the softmax over the union of two disjoint key sets computed
// directly in fp64, including rows where one or both sides saw no key (LSE = -inf).
// Rule: merge is a handful of fp32 operations per element (error a few ulps, ~1e-6 relative),
// so every value is held to the kernel rule's floor, 1e-5 * max(1, |ref|), on any CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>

#include "ctxpar/kernel.h"
#include "ctxpar/reference.h"

namespace ctxpar {
namespace {

double floor_of(double ref) { return reference::accuracy_tolerance(0.0, std::fabs(ref)); }

constexpr float kInf = std::numeric_limits<float>::infinity();

TEST(Merge, MatchesDirectSoftmaxAndHandlesMaskedRows) {
  // [B=1, T=6, H=1, D=3]. Each row i has lse_a, lse_b (some -inf) and outputs o_a, o_b.
  const int64_t T = 6, D = 3;
  const float la[T] = {0.5f, -2.0f, -kInf, 1.0f, -kInf, 80.0f};
  const float lb[T] = {1.5f, -kInf, 3.0f, 1.0f, -kInf, -30.0f};
  Tensor oa(DType::f32, {1, T, 1, D}), ob(DType::f32, {1, T, 1, D});
  Tensor lsea(DType::f32, {1, 1, T}), lseb(DType::f32, {1, 1, T});
  std::vector<double> want_o(T * D), want_lse(T);
  for (int64_t i = 0; i < T; ++i) {
    lsea.ptr<float>()[i] = la[i];
    lseb.ptr<float>()[i] = lb[i];
    for (int64_t c = 0; c < D; ++c) {
      // A fully masked side has O = 0 by the kernel's contract.
      oa.ptr<float>()[i * D + c] = la[i] == -kInf ? 0.0f : 0.1f * (i + 1) + c;
      ob.ptr<float>()[i * D + c] = lb[i] == -kInf ? 0.0f : -0.3f * (i + 2) + 2 * c;
    }
    const double ea = la[i] == -kInf ? 0 : std::exp(double(la[i]) - 80);
    const double eb = lb[i] == -kInf ? 0 : std::exp(double(lb[i]) - 80);
    want_lse[i] = ea + eb == 0 ? -INFINITY : 80 + std::log(ea + eb);
    for (int64_t c = 0; c < D; ++c)
      want_o[i * D + c] =
          ea + eb == 0
              ? 0
              : (ea * oa.ptr<float>()[i * D + c] + eb * ob.ptr<float>()[i * D + c]) / (ea + eb);
  }
  merge(oa, lsea, ob, lseb);
  for (int64_t i = 0; i < T; ++i) {
    const float got = lsea.ptr<float>()[i];
    if (std::isinf(want_lse[i])) {
      EXPECT_EQ(got, -kInf) << "row " << i;
    } else {
      EXPECT_NEAR(got, want_lse[i], floor_of(want_lse[i])) << "row " << i;
    }
    for (int64_t c = 0; c < D; ++c) {
      const float o = oa.ptr<float>()[i * D + c];
      EXPECT_FALSE(std::isnan(o)) << "row " << i;
      EXPECT_NEAR(o, want_o[i * D + c], floor_of(want_o[i * D + c])) << "row " << i << " col " << c;
    }
  }
}

TEST(Merge, IsOrderIndependentUpToRounding) {
  const int64_t B = 2, T = 5, H = 3, D = 16;
  Tensor o[2] = {Tensor(DType::f32, {B, T, H, D}), Tensor(DType::f32, {B, T, H, D})};
  Tensor l[2] = {Tensor(DType::f32, {B, H, T}), Tensor(DType::f32, {B, H, T})};
  for (int s = 0; s < 2; ++s) {
    fill_normal(o[s], 10 + s);
    fill_normal(l[s], 20 + s, 3.0f);
  }
  Tensor ab_o = Tensor::copy_of(o[0]), ab_l = Tensor::copy_of(l[0]);
  Tensor ba_o = Tensor::copy_of(o[1]), ba_l = Tensor::copy_of(l[1]);
  merge(ab_o, ab_l, o[1], l[1]);
  merge(ba_o, ba_l, o[0], l[0]);
  for (int64_t i = 0; i < ab_o.numel(); ++i)
    EXPECT_NEAR(ab_o.ptr<float>()[i], ba_o.ptr<float>()[i], floor_of(ba_o.ptr<float>()[i]));
  for (int64_t i = 0; i < ab_l.numel(); ++i)
    EXPECT_NEAR(ab_l.ptr<float>()[i], ba_l.ptr<float>()[i], floor_of(ba_l.ptr<float>()[i]));
}

TEST(Merge, RejectsMismatchedShapes) {
  Tensor o(DType::f32, {1, 4, 2, 16}), o2(DType::f32, {1, 5, 2, 16});
  Tensor l(DType::f32, {1, 2, 4}), l2(DType::f32, {1, 4, 2});
  EXPECT_THROW(merge(o, l, o2, l), Error);
  EXPECT_THROW(merge(o, l, o, l2), Error);
  Tensor ob(DType::bf16, {1, 4, 2, 16});
  EXPECT_THROW(merge(ob, l, o, l), Error);
}

}  // namespace
}  // namespace ctxpar
