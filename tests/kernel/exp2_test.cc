// The vector exp2 of the fast path against std::exp2 in double: relative error below 3e-7
// (a few fp32 ulps) in the normal range, exactly 1 at 0, exactly 0 below -126 and at -inf; and
// masked scores (-inf) cost no more than others (no underflow assist).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <ctime>
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
    if (in[i] >= -126.0f) {
      EXPECT_LE(std::fabs(out[i] - exact), 3e-7 * exact) << "t = " << in[i];
    } else {  // every target gives 0 here, so their bits agree (no denormals)
      EXPECT_EQ(out[i], 0.0f) << "t = " << in[i];
    }
  }
  const float at_inf = out[std::find(in.begin(), in.end(), -INFINITY) - in.begin()];
  EXPECT_EQ(at_inf, 0.0f);
  EXPECT_EQ(out[std::find(in.begin(), in.end(), 0.0f) - in.begin()], 1.0f);  // P = 1 at the max
}

// The forward's softmax takes scores above its row's base (Note [A row's base], simd_tile.h):
// exp2_capped must give 2^t up to t = 12 with the bits of the t <= 0 form there (every target
// the same: the accuracy bound of exp2_neg), and more than 2^12 for any t above 12 up to +inf,
// which is what moves the base. Without the cap, the targets that build 2^n in the exponent
// bits wrapped t >= 128 into the sign (the LSE came out inf on every AVX2 / SSE target for
// logits ~ 1e4).
TEST(Exp2, CappedAboveZeroAccurateToTwelveAndLargeBeyond) {
  std::vector<float> in, out, neg;
  for (double t = -30; t <= 12; t += 0.0137) in.push_back(static_cast<float>(t));
  for (float t : {12.0f, 12.001f, 13.0f, 13.5f, 100.0f, 127.0f, 128.0f, 1000.0f, 1e30f, INFINITY})
    in.push_back(t);
  out.resize(in.size()), neg.resize(in.size());
  exp2_neg_simd(in.data(), out.data(), static_cast<int64_t>(in.size()), true);
  exp2_neg_simd(in.data(), neg.data(), static_cast<int64_t>(in.size()), false);
  for (size_t i = 0; i < in.size(); ++i) {
    const double exact = std::exp2(static_cast<double>(in[i]));
    if (in[i] <= 12.0f) {
      EXPECT_LE(std::fabs(out[i] - exact), 3e-7 * exact) << "t = " << in[i];
      if (in[i] <= 0.0f) EXPECT_EQ(out[i], neg[i]) << "t = " << in[i];  // the same bits
    } else {
      EXPECT_GT(out[i], 4096.0f) << "t = " << in[i];  // NaN fails too
    }
  }
}

// A result below 2^-126 takes a microcode assist on Intel CPUs (lab 13: ~35x a vector's time),
// and the scores a mask hides are -inf: a causal step's skipped tiles once paid it for every
// one. Masked scores must cost about what visible ones do; calibrated in the same run (the
// unmasked pass is the measure). Timed by this thread's CPU time, the three inputs alternating,
// best of 9 rounds each: by wall time, with the inputs timed one after another, a burst of
// other processes (an oversubscribed MPI test beside it in `ctest -j2`) once landed on all five
// repetitions of one input and failed it at 2.3x. Thread CPU time on a KVM guest still counts
// what the host takes from the vCPU: one cold CI run on X2/207a (kernel_ssse3 beside
// kernel_sse4) had the -140 input's best of 9 at 3x, and the same binary gave 1.0x in five runs
// alone. A slow path is a property of the instructions and shows in every measurement, so the
// test measures again, up to 3 times, and fails only if every measurement is over the bound.
TEST(Exp2, MaskedScoresCostNoMoreThanVisibleOnes) {
  const int64_t n = 1 << 16;
  std::vector<float> visible(n), masked(n, -INFINITY), below(n, -140.0f), out(n);
  for (int64_t i = 0; i < n; ++i) visible[i] = -static_cast<float>(i % 97) / 8.0f;
  auto thread_seconds = [] {
    timespec t;
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
  };
  auto seconds = [&](const std::vector<float>& in) {
    const double t0 = thread_seconds();
    for (int pass = 0; pass < 32; ++pass) exp2_neg_simd(in.data(), out.data(), n);
    return thread_seconds() - t0;
  };
  seconds(visible), seconds(masked), seconds(below);  // pages touched
  double t_visible = 0, t_masked = 0, t_below = 0;
  for (int attempt = 0; attempt < 3; ++attempt) {
    t_visible = t_masked = t_below = 1e300;
    for (int round = 0; round < 9; ++round) {
      t_visible = std::min(t_visible, seconds(visible));
      t_masked = std::min(t_masked, seconds(masked));
      t_below = std::min(t_below, seconds(below));
    }
    std::printf("exp2 over 2^16 values: visible %.3g s, -inf %.3g s, -140 %.3g s\n", t_visible,
                t_masked, t_below);
    if (t_masked < 2.0 * t_visible && t_below < 2.0 * t_visible) break;
  }
  EXPECT_LT(t_masked, 2.0 * t_visible) << "2^-inf takes a slow path (3 measurements)";
  EXPECT_LT(t_below, 2.0 * t_visible) << "2^-140 takes a slow path (3 measurements)";
}

}  // namespace
}  // namespace ctxpar::kernel
