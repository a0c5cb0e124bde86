// The vector exp2 of the fast path against std::exp2 in double: relative error below 3e-7
// (a few fp32 ulps) in the normal range, exactly 0 at -inf, and never above 2^-126 below it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernel/problem.h"

namespace ctxpar::kernel {
namespace {

// On the SIMD target in use (CTXPAR_SIMD; AVX-512 and the others build 2^n differently).
TEST(Exp2, AccurateAndZeroForMaskedScores) {
  std::vector<float> in, out;
  for (double t = -160; t <= 0; t += 0.0137) in.push_back(static_cast<float>(t));
  in.push_back(0.0f), in.push_back(-0.5f), in.push_back(-126.0f), in.push_back(-INFINITY);
  out.resize(in.size());
  exp2_neg_simd(in.data(), out.data(), static_cast<int64_t>(in.size()));
  for (size_t i = 0; i < in.size(); ++i) {
    const double exact = std::exp2(static_cast<double>(in[i]));
    if (in[i] >= -125.0f) {
      EXPECT_LE(std::fabs(out[i] - exact), 3e-7 * exact) << "t = " << in[i];
    } else {
      EXPECT_GE(out[i], 0.0f) << "t = " << in[i];
      EXPECT_LE(out[i], 0x1p-125f) << "t = " << in[i];
    }
  }
  const float at_inf = out[std::find(in.begin(), in.end(), -INFINITY) - in.begin()];
  EXPECT_EQ(at_inf, 0.0f);
}

}  // namespace
}  // namespace ctxpar::kernel
