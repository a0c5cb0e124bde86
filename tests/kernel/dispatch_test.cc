// The SIMD target in use is the one asked for (CTXPAR_SIMD, set per ctest entry) or else the
// best this CPU runs, and the kernel really runs it (its vector width). The other kernel tests
// of this binary then cover that target.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "ctxpar/kernel.h"
#include "kernel/peak.h"

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

TEST(Dispatch, PortableBuildHasEveryX86Target) {
  const SimdTargets t = simd_targets();
  if (t.compiled.size() == 1) GTEST_SKIP() << "a -march=native build: one static target";
  for (const char* name : {"avx512", "avx2", "sse4"})
    EXPECT_TRUE(contains(t.compiled, name)) << name << " not compiled in";
}

}  // namespace
}  // namespace ctxpar
