// The SIMD target in use is the one asked for (CTXPAR_SIMD, set per ctest entry) or else the
// best this CPU runs, and the kernel really runs it (its vector width). The other kernel tests
// of this binary then cover that target.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "ctxpar/kernel.h"
#include "kernel/peak.h"
#include "kernel/problem.h"

namespace ctxpar {
namespace {

bool contains(const std::vector<std::string>& v, const std::string& x) {
  return std::find(v.begin(), v.end(), x) != v.end();
}

TEST(Dispatch, ChosenTargetIsTheRequestedOrTheBest) {
  const SimdTargets t = simd_targets();
  ASSERT_EQ(t.error, "");  // else the environment skipped the binary
  ASSERT_FALSE(t.compiled.empty());
  ASSERT_FALSE(t.runnable.empty()) << "the build's own baseline target always runs";
  for (const std::string& r : t.runnable) EXPECT_TRUE(contains(t.compiled, r)) << r;
  const char* want = std::getenv("CTXPAR_SIMD");
  if (want != nullptr && *want != '\0') {
    EXPECT_EQ(t.chosen, want);
  } else if (std::getenv("CTXPAR_KERNEL") == nullptr) {
    EXPECT_EQ(t.chosen, t.runnable.front()) << "the best runnable target";
  }
  if (t.chosen == "scalar") return;
  // The kernel's vector width is the chosen target's.
  const int lanes = kernel::simd_lanes();
  const int want_lanes = t.chosen == "avx512" || t.chosen == "avx512_dl" ? 16
                         : t.chosen == "avx2"                           ? 8
                                                                        : 4;  // sse4, ssse3
  EXPECT_EQ(lanes, want_lanes) << t.chosen;
  EXPECT_EQ(std::string(kernel::simd_target_name()), t.chosen);
}

// Issue 26: bf16 products only where the probe measured them faster (or CTXPAR_BF16_PRODUCTS
// forces them); the rule on both outcomes of the measurement, and the overrides.
TEST(Bf16Products, RuleOnBothOutcomesAndOverrides) {
  using kernel::decide_bf16_products;
  const kernel::Bf16Choice slow = decide_bf16_products(nullptr, true, 100, 48);  // this guest
  EXPECT_FALSE(slow.use);
  EXPECT_NE(slow.reason.find("0.48x the fp32 FMA"), std::string::npos) << slow.reason;
  EXPECT_TRUE(decide_bf16_products(nullptr, true, 100, 200).use);  // a full-rate bf16 core
  EXPECT_TRUE(decide_bf16_products("auto", true, 100, 125).use);
  EXPECT_FALSE(decide_bf16_products("auto", true, 100, 124).use);
  EXPECT_FALSE(decide_bf16_products("off", true, 100, 200).use);
  EXPECT_TRUE(decide_bf16_products("on", true, 100, 48).use);
  const kernel::Bf16Choice none = decide_bf16_products(nullptr, false, 0, 0);
  EXPECT_FALSE(none.use);
  EXPECT_EQ(none.error, "");
  EXPECT_NE(none.reason.find("no AVX512_BF16"), std::string::npos) << none.reason;
  EXPECT_NE(decide_bf16_products("on", false, 0, 0).error.find("lacks AVX512_BF16"),
            std::string::npos);
  EXPECT_NE(decide_bf16_products("yes", true, 0, 0).error.find("CTXPAR_BF16_PRODUCTS=yes"),
            std::string::npos);
}

// What this process chose is what `ctxpar --version` reports; unforced on a bf16 CPU it was
// measured.
TEST(Bf16Products, ThisCpusChoiceIsReported) {
  const kernel::Bf16Choice& c = kernel::bf16_products();
  EXPECT_EQ(simd_targets().products.rfind(c.reason, 0), 0u) << simd_targets().products;
  EXPECT_FALSE(c.reason.empty());
  const char* e = std::getenv("CTXPAR_BF16_PRODUCTS");
  if ((e == nullptr || *e == '\0') && c.reason.find("measured") != std::string::npos) {
    EXPECT_GT(c.fma_gflops, 0);
    EXPECT_GT(c.dot_gflops, 0);
    EXPECT_EQ(c.use, c.dot_gflops >= kernel::kBf16Pays * c.fma_gflops);
  }
}

TEST(Dispatch, PortableBuildHasEveryX86Target) {
  const SimdTargets t = simd_targets();
  if (t.compiled.size() == 1) GTEST_SKIP() << "a -march=native build: one static target";
  for (const char* name : {"avx512", "avx2", "sse4"})
    EXPECT_TRUE(contains(t.compiled, name)) << name << " not compiled in";
}

}  // namespace
}  // namespace ctxpar
