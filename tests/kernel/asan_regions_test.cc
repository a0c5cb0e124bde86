// The micro-kernels run without AddressSanitizer's per-load checks and check their operands'
// regions once per call instead (src/kernel/asan_regions.h, Note [Hot loops under
// AddressSanitizer]). Under the sanitizer build an operand one row short must still be reported,
// as a per-load check would have; an exact fit must not be. In other builds the checks are
// nothing, and the first test says so by skipping.
#include <gtest/gtest.h>

#include <memory>
#include <vector>

#include "kernel/asan_regions.h"
#include "kernel/simd_tile.h"

namespace ctxpar {
namespace {

namespace simd = kernel::HWY_NAMESPACE;

// C[m x n] = A[m x k] B[k x n] through gemm_rows, each operand in a heap block of exactly the
// floats it needs (b_rows rows of B: k for a correct call), so that one float past any of them
// is outside its allocation.
std::vector<float> product(int64_t m, int64_t n, int64_t k, int64_t b_rows) {
  auto a = std::make_unique<float[]>(m * k), b = std::make_unique<float[]>(b_rows * n),
       c = std::make_unique<float[]>(m * n);
  for (int64_t i = 0; i < m * k; ++i) a[i] = static_cast<float>(i % 7) - 3;
  for (int64_t i = 0; i < b_rows * n; ++i) b[i] = static_cast<float>(i % 5) - 2;
  simd::gemm_rows(m, n, k, a.get(), k, b.get(), n, c.get(), n, false);
  return std::vector<float>(c.get(), c.get() + m * n);
}

TEST(AsanRegions, AnOperandOneRowShortIsReported) {
#ifndef CTXPAR_ASAN
  GTEST_SKIP() << "only the AddressSanitizer build checks memory (scripts/sanitize.sh)";
#else
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int64_t n = 2 * simd::lanes();
  EXPECT_DEATH(product(6, n, 8, 7), "AddressSanitizer");  // B has 7 of its 8 rows
#endif
}

TEST(AsanRegions, ExactOperandsPassAndMultiply) {
  // Small integers: every sum is exact in fp32, so C must equal the integer product.
  const int64_t m = 8, n = 2 * simd::lanes(), k = 9;
  const std::vector<float> c = product(m, n, k, k);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double want = 0;
      for (int64_t x = 0; x < k; ++x)
        want +=
            (static_cast<double>((i * k + x) % 7) - 3) * (static_cast<double>((x * n + j) % 5) - 2);
      ASSERT_EQ(c[i * n + j], want) << "C[" << i << "][" << j << "]";
    }
}

}  // namespace
}  // namespace ctxpar
