// The kernel tests' AMX fixture: CTXPAR_SKIP_WITHOUT_AMX() skips, saying why, where AMX-BF16 is
// not usable; AmxForced gives the test's kernel calls the AMX products to ask for
// (KernelConfig::bf16_products = kProducts), skipping where the SIMD target in use is not an
// avx512 one; DotForced the same for vdpbf16ps. top_products(): the levels a test of ranks that
// disagree gives them.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "ctxpar/kernel.h"
#include "kernel/amx_probe.h"
#include "kernel/problem.h"

#define CTXPAR_SKIP_WITHOUT_AMX()                                                           \
  do {                                                                                      \
    if (!::ctxpar::kernel::amx_unusable_why().empty())                                      \
      GTEST_SKIP() << "AMX-BF16 not usable here: " << ::ctxpar::kernel::amx_unusable_why(); \
  } while (false)

namespace ctxpar::test {

// The bf16 products of `level` (kernel::kBf16Dot or kBf16Amx) for the test's kernel calls to
// ask for (kProducts); skips, saying why, where the CPU lacks them or the SIMD target in use is
// not an avx512 one.
template <int level>
class ProductsForced : public ::testing::Test {
 protected:
  static constexpr Bf16Products kProducts = kernel::bf16_products_of_level(level);
  void SetUp() override {
    if (level == kernel::kBf16Amx) CTXPAR_SKIP_WITHOUT_AMX();
    __builtin_cpu_init();
    if (level == kernel::kBf16Dot && !__builtin_cpu_supports("avx512bf16"))
      GTEST_SKIP() << "this CPU has no AVX512_BF16 (vdpbf16ps)";
    KernelConfig config;
    config.bf16_products = kProducts;
    if (kernel::bf16_products_on(config) != level)
      GTEST_SKIP() << "the SIMD target in use (" << simd_targets().chosen
                   << ") is not an avx512 one: products stay fp32";
  }
};
using AmxForced = ProductsForced<kernel::kBf16Amx>;
using DotForced = ProductsForced<kernel::kBf16Dot>;

// The top bf16-products level kernel calls take here (AMX where usable) and the one below it,
// for the tests of ranks that disagree on them; `skip` says why there is no choice ("" when
// there is one).
struct TopProducts {
  Bf16Products high = Bf16Products::fp32, low = Bf16Products::fp32;
  std::string skip;
};
inline TopProducts top_products() {
  TopProducts t;
  const int top = kernel::bf16_top_level();
  KernelConfig config;
  config.bf16_products = kernel::bf16_products_of_level(top);
  if (top == 0 || kernel::bf16_products_on(config) != top) {
    t.skip = "no bf16 products to choose here (CPU or SIMD target " + simd_targets().chosen + ")";
    return t;
  }
  t.high = config.bf16_products, t.low = kernel::bf16_products_of_level(top - 1);
  return t;
}

}  // namespace ctxpar::test
