// The SIMD target in use is the one asked for (CTXPAR_SIMD, set per ctest entry) or else the
// best this CPU runs, and the kernel really runs it (its vector width). The other kernel tests
// of this binary then cover that target.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <string>

#include "core/environment.h"
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
                         : t.chosen == "avx2"                            ? 8
                                                                         : 4;  // sse4, ssse3
  EXPECT_EQ(lanes, want_lanes) << t.chosen;
  EXPECT_EQ(std::string(kernel::simd_target_name()), t.chosen);
}

// bf16 products only where the probe measured them faster (or CTXPAR_BF16_PRODUCTS
// forces them); the rule on every outcome of the measurement (fp32, vdpbf16ps, AMX), and the
// overrides.
TEST(Bf16Products, RuleOnEveryOutcomeAndOverrides) {
  using kernel::decide_bf16_products;
  constexpr int fp32 = kernel::kBf16Fp32, dot = kernel::kBf16Dot, amx = kernel::kBf16Amx;
  const kernel::Bf16Choice slow = decide_bf16_products(nullptr, true, 100, 48);  // no AMX
  EXPECT_EQ(slow.level, fp32);
  EXPECT_NE(slow.reason.find("0.48x the fp32 FMA"), std::string::npos) << slow.reason;
  EXPECT_NE(slow.reason.find("AMX-BF16 not usable: no AMX"), std::string::npos) << slow.reason;
  EXPECT_EQ(decide_bf16_products(nullptr, true, 100, 200).level, dot);  // a full-rate bf16 core
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 125).level, dot);
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 124).level, fp32);
  EXPECT_EQ(decide_bf16_products("off", true, 100, 200).level, fp32);
  EXPECT_EQ(decide_bf16_products("on", true, 100, 48).level, dot);
  EXPECT_EQ(decide_bf16_products("dot", true, 100, 48).level, dot);
  // AMX usable ("" why): this guest (vdpbf16ps 0.48x, tiles 14x) takes AMX; tiles below
  // kAmxPays, or slower than a full-rate vdpbf16ps, do not.
  const kernel::Bf16Choice guest = decide_bf16_products(nullptr, true, 100, 48, "", 1400);
  EXPECT_EQ(guest.level, amx);
  EXPECT_NE(guest.reason.find("AMX-BF16 tile products for bf16 inputs (measured: vdpbf16ps "
                              "0.48x the fp32 FMA FLOP/s; bf16 needs 1.25x; AMX-BF16 tile "
                              "products 14.00x, AMX needs 2.00x"),
            std::string::npos)
      << guest.reason;
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 48, "", 200).level, amx);
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 48, "", 199).level, fp32);
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 130, "", 199).level, dot);
  EXPECT_EQ(decide_bf16_products("auto", true, 100, 300, "", 250).level, dot);
  EXPECT_EQ(decide_bf16_products("off", true, 100, 48, "", 1400).level, fp32);
  EXPECT_EQ(decide_bf16_products("on", true, 100, 48, "", 1400).level, dot);
  EXPECT_EQ(decide_bf16_products("amx", true, 100, 300, "", 0).level, amx);
  const kernel::Bf16Choice refused =
      decide_bf16_products("amx", true, 0, 0, "this CPU has no AMX-BF16");
  EXPECT_EQ(refused.level, fp32);
  EXPECT_NE(refused.error.find("CTXPAR_BF16_PRODUCTS=amx: AMX-BF16 is not usable here (this CPU "
                               "has no AMX-BF16)"),
            std::string::npos)
      << refused.error;
  const kernel::Bf16Choice none = decide_bf16_products(nullptr, false, 0, 0);
  EXPECT_EQ(none.level, fp32);
  EXPECT_EQ(none.error, "");
  EXPECT_NE(none.reason.find("no AVX512_BF16"), std::string::npos) << none.reason;
  EXPECT_NE(decide_bf16_products("on", false, 0, 0).error.find("lacks AVX512_BF16"),
            std::string::npos);
  EXPECT_NE(decide_bf16_products("dot", false, 0, 0).error.find("CTXPAR_BF16_PRODUCTS=dot"),
            std::string::npos);
  EXPECT_NE(decide_bf16_products("yes", true, 0, 0).error.find("CTXPAR_BF16_PRODUCTS=yes"),
            std::string::npos);
}

// KernelConfig::bf16_products: each level is its own, automatic this machine's choice; a level
// the CPU cannot take is refused, naming the field and what to ask for instead (kernel calls
// with bf16 inputs throw it). The ranks' agreement on the lowest level: strategy
// Bf16Agreement.*, strategy_mpi_*, inference_mpi_*.
TEST(Bf16Products, ConfigLevelsAndRefusals) {
  using kernel::bf16_products_refusal;
  EXPECT_EQ(kernel::bf16_products_level(Bf16Products::automatic), kernel::bf16_products().level);
  for (const int level : {kernel::kBf16Fp32, kernel::kBf16Dot, kernel::kBf16Amx})
    EXPECT_EQ(kernel::bf16_products_level(kernel::bf16_products_of_level(level)), level);
  for (const Bf16Products p : {Bf16Products::automatic, Bf16Products::fp32})
    EXPECT_EQ(bf16_products_refusal(p, false, "no AMX"), "") << bf16_products_name(p);
  EXPECT_EQ(bf16_products_refusal(Bf16Products::dot, true, "no AMX"), "");
  EXPECT_EQ(bf16_products_refusal(Bf16Products::dot, false, "no AMX"),
            "KernelConfig::bf16_products = dot: this CPU lacks AVX512_BF16 (vdpbf16ps); use "
            "automatic or fp32");
  EXPECT_EQ(bf16_products_refusal(Bf16Products::amx, true, ""), "");
  EXPECT_EQ(bf16_products_refusal(Bf16Products::amx, true, "this CPU has no AMX-BF16"),
            "KernelConfig::bf16_products = amx: AMX-BF16 is not usable here (this CPU has no "
            "AMX-BF16); use automatic, dot or fp32");
  // This machine: the levels up to its top one are taken, the ones above refused.
  const int top = kernel::bf16_top_level();
  for (const int level : {kernel::kBf16Dot, kernel::kBf16Amx})
    EXPECT_EQ(kernel::bf16_products_refusal(kernel::bf16_products_of_level(level)).empty(),
              level <= top)
        << level;
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
    const bool amx =
        c.amx_gflops >= kernel::kAmxPays * c.fma_gflops && c.amx_gflops >= c.dot_gflops;
    EXPECT_EQ(c.level, amx                                                ? kernel::kBf16Amx
                       : c.dot_gflops >= kernel::kBf16Pays * c.fma_gflops ? kernel::kBf16Dot
                                                                          : kernel::kBf16Fp32);
  }
}

// The kernel's environment comes from the edge (core/environment.h reads the variables;
// this program installed them, environment_support.cc): the kernel keeps the one its choices
// were made from, so a different one afterwards is refused, and the same one again is not.
TEST(KernelEnvironment, ReadAtTheEdgeAndKeptOnceUsed) {
  const char* names[] = {"CTXPAR_SIMD", "CTXPAR_KERNEL", "CTXPAR_BF16_PRODUCTS",
                         "CTXPAR_KERNEL_L1D", "CTXPAR_FP32_PRODUCTS"};
  const KernelEnvironment installed = environment::kernel();
  std::string saved[5];
  for (int i = 0; i < 5; ++i) {
    const char* v = std::getenv(names[i]);
    saved[i] = v != nullptr ? v : "";
    setenv(names[i], ("value " + std::to_string(i)).c_str(), 1);
  }
  const KernelEnvironment read = environment::kernel();
  for (int i = 0; i < 5; ++i)
    saved[i].empty() ? unsetenv(names[i]) : setenv(names[i], saved[i].c_str(), 1);
  EXPECT_EQ(read.simd, "value 0");
  EXPECT_EQ(read.kernel, "value 1");
  EXPECT_EQ(read.bf16_products, "value 2");
  EXPECT_EQ(read.l1d, "value 3");
  EXPECT_EQ(read.fp32_products, "value 4");
  EXPECT_TRUE(environment::kernel() == installed);

  (void)simd_targets();  // the choices are made
  EXPECT_NO_THROW(set_kernel_environment(installed));
  try {
    set_kernel_environment(read);
    ADD_FAILURE() << "a second environment was taken after the kernel's choices were made";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("already made"), std::string::npos) << e.what();
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
