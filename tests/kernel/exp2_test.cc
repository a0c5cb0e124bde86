// The vector exp2 of the fast path against std::exp2 in double: relative error below 3e-7
// (a few fp32 ulps) in the normal range, exactly 0 at -inf, and never above 2^-126 below it.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernel/simd_tile.h"

namespace ctxpar::kernel::simd {
namespace {

TEST(Exp2, AccurateAndZeroForMaskedScores) {
  const DF d;
  const int64_t n = lanes();
  std::vector<float> in, out;
  for (double t = -160; t <= 0; t += 0.0137) in.push_back(static_cast<float>(t));
  in.push_back(0.0f), in.push_back(-0.5f), in.push_back(-126.0f), in.push_back(-INFINITY);
  while (in.size() % n) in.push_back(-1.0f);
  out.resize(in.size());
  for (size_t i = 0; i < in.size(); i += n)
    hn::StoreU(exp2_neg(d, hn::LoadU(d, in.data() + i)), d, out.data() + i);
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
}  // namespace ctxpar::kernel::simd
