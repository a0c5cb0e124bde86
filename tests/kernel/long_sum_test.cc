// dK / dV at long T: the first key tile under a causal mask is seen by every query
// row, so its gradient sums T of them. Its error against fp64 must not grow with T: the rule
// is a fixed number of fp32 ulps of the largest |reference|, which one running fp32 sum over
// the T rows exceeded (docs/kernel.md "Note [Blocked dK / dV]").
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "kernel/kernel_support.h"
#include "kernel/problem.h"

namespace ctxpar::test {
namespace {

// The fp64 dK and dV of key rows [0, keys) of one head ([1, T, 1, D] inputs, causal), with
// the full forward (lse, O, delta) of every query row; rows of [keys][D].
struct FirstKeys {
  std::vector<double> dk, dv;
};
FirstKeys reference_first_keys(const Inputs& in, int64_t keys) {
  const int64_t t = in.q.dim(1), d = in.q.dim(3);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  auto row = [&](const Tensor& x, int64_t i) { return x.ptr<const float>() + i * d; };
  FirstKeys r{std::vector<double>(keys * d, 0.0), std::vector<double>(keys * d, 0.0)};
  std::vector<double> s(t), o(d);
  for (int64_t i = 0; i < t; ++i) {
    const float* qi = row(in.q, i);
    double mx = -INFINITY;
    for (int64_t j = 0; j <= i; ++j) {
      const float* kj = row(in.k, j);
      double x = 0;
      for (int64_t c = 0; c < d; ++c) x += static_cast<double>(qi[c]) * kj[c];
      s[j] = x * scale;
      mx = std::max(mx, s[j]);
    }
    double l = 0;
    std::fill(o.begin(), o.end(), 0.0);
    for (int64_t j = 0; j <= i; ++j) {
      s[j] = std::exp(s[j] - mx);
      l += s[j];
      const float* vj = row(in.v, j);
      for (int64_t c = 0; c < d; ++c) o[c] += s[j] * vj[c];
    }
    const float* doi = row(in.dout, i);
    double delta = 0;
    for (int64_t c = 0; c < d; ++c) delta += doi[c] * (o[c] / l);
    for (int64_t j = 0; j < std::min(keys, i + 1); ++j) {
      const double p = s[j] / l;
      const float* vj = row(in.v, j);
      double dp = 0;
      for (int64_t c = 0; c < d; ++c) dp += static_cast<double>(doi[c]) * vj[c];
      const double ds = p * (dp - delta) * scale;
      for (int64_t c = 0; c < d; ++c) {
        r.dk[j * d + c] += ds * qi[c];
        r.dv[j * d + c] += p * doi[c];
      }
    }
  }
  return r;
}

double max_err_rows(const Tensor& got, const std::vector<double>& ref) {
  double m = 0;
  for (size_t x = 0; x < ref.size(); ++x)
    m = std::max(m, std::fabs(static_cast<double>(got.ptr<const float>()[x]) - ref[x]));
  return m;
}

TEST(LongSum, FirstKeyTileGradientsWithinFixedUlps) {
  if (kernel::use_scalar_path())
    GTEST_SKIP() << "the readable scalar path sums in one running order";
  Case c;
  c.tq = c.tk = 8192;
  c.hq = c.hkv = 1;
  c.d = 64;
  c.mask.causal = true;
  const Inputs in = make_inputs(c);
  const Outputs fast = run_fast(in, c.mask, 1);
  constexpr int64_t kKeys = 64;
  const FirstKeys ref = reference_first_keys(in, kKeys);
  // 16 ulps (2^-20) of the largest |reference|: a block partial's running sum over
  // kDkvBlock x 64 = 256 rows and a compensated sum of the blocks stay within it at any T (the
  // bound depends on the block, not on T); one running sum over the 8192 rows did not.
  const double dk_err = max_err_rows(fast.dk, ref.dk), dv_err = max_err_rows(fast.dv, ref.dv);
  const double dk_rule = 0x1.0p-20 * max_abs(ref.dk), dv_rule = 0x1.0p-20 * max_abs(ref.dv);
  std::printf(
      "T=%lld dk: err %.3g rule %.3g (max|ref| %.3g); dv: err %.3g rule %.3g (max|ref| %.3g)\n",
      static_cast<long long>(c.tq), dk_err, dk_rule, max_abs(ref.dk), dv_err, dv_rule,
      max_abs(ref.dv));
  EXPECT_LE(dk_err, dk_rule);
  EXPECT_LE(dv_err, dv_rule);
}

}  // namespace
}  // namespace ctxpar::test
