// gemm_rows_at (simd_tile.h): C (+)= A B with A given transposed, as the fp32 backward's dV and
// dK read P and scale dS where softmax_gradient left them. It must make the same FMAs in the same
// order as gemm_rows on a transposed copy of A (so the backward's bits did not change), and be
// the product within the naive fp32 sum's bound against fp64.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "kernel/lines.h"
#include "kernel/simd_tile.h"

namespace ctxpar {
namespace {

namespace simd = kernel::HWY_NAMESPACE;
using kernel::LineVector;

// Values of both signs over a few binades (a linear congruential generator; seeded per call).
void fill(LineVector<float>& v, uint64_t seed) {
  for (float& x : v) {
    seed = seed * 6364136223846793005ull + 1442695040888963407ull;
    const double u = static_cast<double>(seed >> 11) * 0x1p-53;  // [0, 1)
    x = static_cast<float>((u - 0.5) * std::exp2(4.0 * u));
  }
}

TEST(GemmRowsAt, SameBitsAsGemmRowsOnTheTransposedCopyAndWithinTheFp32Bound) {
  const int64_t nl = simd::lanes();
  int cases = 0;
  // Rows through every register block (6, 4, 2 and their mixes); columns through the kC-vector
  // strips and the single vectors after them; depths 1, odd and the backward's 64.
  for (int64_t m : {2, 4, 6, 10, 64})
    for (int64_t n : {nl, 4 * nl, 9 * nl})
      for (int64_t k : {1, 7, 64})
        for (bool accumulate : {false, true}) {
          const int64_t lda_t = m + 3, lda = k + 1, ldb = n + nl, ldc = n + 2 * nl;
          LineVector<float> at(k * lda_t), a(m * lda), b(k * ldb), c0(m * ldc);
          fill(at, static_cast<uint64_t>(m * 1000 + n * 10 + k));
          fill(b, static_cast<uint64_t>(k * 77 + n));
          fill(c0, static_cast<uint64_t>(m + 5));
          for (int64_t r = 0; r < m; ++r)
            for (int64_t x = 0; x < k; ++x) a[r * lda + x] = at[x * lda_t + r];
          LineVector<float> c_rows(c0.begin(), c0.end()), c_at(c0.begin(), c0.end());
          simd::gemm_rows(m, n, k, a.data(), lda, b.data(), ldb, c_rows.data(), ldc, accumulate);
          simd::gemm_rows_at(m, n, k, at.data(), lda_t, b.data(), ldb, c_at.data(), ldc,
                             accumulate);
          for (int64_t r = 0; r < m; ++r)
            for (int64_t j = 0; j < n; ++j) {
              const float got = c_at[r * ldc + j];
              ASSERT_EQ(std::memcmp(&got, &c_rows[r * ldc + j], sizeof got), 0)
                  << "m " << m << " n " << n << " k " << k << " accumulate " << accumulate << ": C["
                  << r << "][" << j << "] " << got << " against gemm_rows' " << c_rows[r * ldc + j];
              // fp64 reference; a naive fp32 sum of k + 1 terms is within (k + 1) 2^-24 of the
              // sum of their magnitudes.
              double ref = accumulate ? c0[r * ldc + j] : 0.0, mag = std::fabs(ref);
              for (int64_t x = 0; x < k; ++x) {
                const double t = static_cast<double>(at[x * lda_t + r]) * b[x * ldb + j];
                ref += t, mag += std::fabs(t);
              }
              ASSERT_LE(std::fabs(got - ref), static_cast<double>(k + 1) * 0x1p-24 * mag)
                  << "m " << m << " n " << n << " k " << k << ": C[" << r << "][" << j << "]";
            }
          ++cases;
        }
  EXPECT_EQ(cases, 5 * 3 * 3 * 2);
}

// gemm_rows_at_compensated: a dK / dV block's last tile and the block's flush in one pass, with
// the bits of gemm_rows_at into the partial followed by add_compensated (sum and comp start
// non-zero, as after earlier blocks; C, the partial, must be left as it was).
TEST(GemmRowsAt, CompensatedIsTheProductThenTheFlush) {
  const int64_t nl = simd::lanes();
  for (int64_t m : {4, 10, 64})
    for (int64_t n : {nl, 8 * nl})
      for (int64_t k : {3, 64}) {
        const int64_t lda_t = m + 1, ld = n + nl;
        LineVector<float> at(k * lda_t), b(k * ld), part(m * ld), sum(m * ld), comp(m * ld);
        fill(at, static_cast<uint64_t>(m + n + k)), fill(b, static_cast<uint64_t>(n * k));
        fill(part, 11), fill(sum, 12), fill(comp, 13);
        for (float& x : comp) x *= 0x1p-24f;  // what earlier additions lost: ulps of the sum
        LineVector<float> p1(part.begin(), part.end()), s1(sum.begin(), sum.end()),
            c1(comp.begin(), comp.end());
        simd::gemm_rows_at(m, n, k, at.data(), lda_t, b.data(), ld, p1.data(), ld, true);
        for (int64_t r = 0; r < m; ++r)
          simd::add_compensated(n, p1.data() + r * ld, s1.data() + r * ld, c1.data() + r * ld);
        LineVector<float> p2(part.begin(), part.end()), s2(sum.begin(), sum.end()),
            c2(comp.begin(), comp.end());
        simd::gemm_rows_at_compensated(m, n, k, at.data(), lda_t, b.data(), ld, p2.data(), ld,
                                       s2.data(), c2.data());
        ASSERT_EQ(std::memcmp(s1.data(), s2.data(), s1.size() * sizeof(float)), 0)
            << "sum, m " << m << " n " << n << " k " << k;
        ASSERT_EQ(std::memcmp(c1.data(), c2.data(), c1.size() * sizeof(float)), 0)
            << "comp, m " << m << " n " << n << " k " << k;
        ASSERT_EQ(std::memcmp(part.data(), p2.data(), part.size() * sizeof(float)), 0)
            << "the partial was written, m " << m << " n " << n << " k " << k;
      }
}

// Columns past m in each row of the transposed A and rows past k are never read: NaN there must
// not reach C (the backward's P and dS tiles hold 64 columns whatever the key tile's width).
TEST(GemmRowsAt, ReadsOnlyItsRegion) {
  const int64_t nl = simd::lanes(), m = 6, n = 4 * nl, k = 5, lda_t = 16;
  LineVector<float> at((k + 1) * lda_t, std::nanf("")), b(k * n, 1.0f), c(m * n, 0.0f);
  for (int64_t x = 0; x < k; ++x)
    for (int64_t r = 0; r < m; ++r) at[x * lda_t + r] = static_cast<float>(r + 1);
  simd::gemm_rows_at(m, n, k, at.data(), lda_t, b.data(), n, c.data(), n, false);
  for (int64_t r = 0; r < m; ++r)
    for (int64_t j = 0; j < n; ++j)
      ASSERT_EQ(c[r * n + j], static_cast<float>(k * (r + 1))) << "C[" << r << "][" << j << "]";
}

}  // namespace
}  // namespace ctxpar
