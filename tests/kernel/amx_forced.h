// The kernel tests' AMX fixture (issue 26): CTXPAR_SKIP_WITHOUT_AMX() skips, saying why, where
// AMX-BF16 is not usable; AmxForced forces the AMX products for the test's body (and puts the
// probe's choice back after), skipping where the SIMD target in use is not an avx512 one.
#pragma once
#include <gtest/gtest.h>

#include "ctxpar/kernel.h"
#include "kernel/amx_probe.h"
#include "kernel/problem.h"

#define CTXPAR_SKIP_WITHOUT_AMX()                                                        \
  if (!::ctxpar::kernel::amx_unusable_why().empty())                                    \
    GTEST_SKIP() << "AMX-BF16 not usable here: " << ::ctxpar::kernel::amx_unusable_why();

namespace ctxpar::test {

class AmxForced : public ::testing::Test {
 protected:
  void SetUp() override {
    CTXPAR_SKIP_WITHOUT_AMX();
    kernel::set_bf16_products_for_test(kernel::kBf16Amx);
    if (kernel::bf16_products_on() != kernel::kBf16Amx)
      GTEST_SKIP() << "the SIMD target in use (" << simd_targets().chosen
                   << ") is not an avx512 one: products stay fp32";
  }
  void TearDown() override { kernel::set_bf16_products_for_test(-1); }
};

}  // namespace ctxpar::test
