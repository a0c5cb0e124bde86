// Issue 26: the exact bf16 products (kernel/simd_bf16.h). The fp64 reference tests of this
// binary run on both outcomes (ctest entries kernel_bf16_on / kernel_bf16_off force them); these
// check the pieces: the forced choice is the one kernel calls take, the products are exact
// and summed in fp32, and the backward's delta adds exactly as its bf16 dP does.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "ctxpar/kernel.h"
#include "kernel/amx_probe.h"
#include "kernel/kernel_support.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"

namespace ctxpar {
namespace {

bool cpu_has_bf16() {
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bf16");
}

float widen(uint16_t h) {
  const uint32_t u = uint32_t{h} << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// CTXPAR_BF16_PRODUCTS=on|off is what kernel calls take (on an avx512 target; the others keep
// fp32 and say so in the products line).
TEST(Bf16Products, ForcedChoiceIsWhatKernelCallsTake) {
  const char* e = std::getenv("CTXPAR_BF16_PRODUCTS");
  const std::string want = e != nullptr ? e : "";
  const SimdTargets t = simd_targets();
  const bool avx512 = t.chosen == "avx512" || t.chosen == "avx512_dl";
  if (want == "off") EXPECT_FALSE(kernel::bf16_products_on());
  if (want == "on" && cpu_has_bf16()) {
    EXPECT_EQ(kernel::bf16_products_on(), avx512) << t.chosen;
    if (!avx512) EXPECT_NE(t.products.find("not applied"), std::string::npos) << t.products;
  }
  if (!cpu_has_bf16()) EXPECT_FALSE(kernel::bf16_products().use);
}

// C = mul * (A B) over bf16 pairs: every product exact, the sums fp32 (error within the
// fp32 bound n u sum |a b| of a sequential sum), D odd (a zero half pair).
TEST(Bf16Products, ScoresAreExactProductsSummedInFp32) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  const int64_t d = 101, m = 10, np = kernel::bf16::pairs(d), ld = kernel::bf16::row_words(d);
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0, 1);
  Tensor q(DType::bf16, {1, m, 1, d}), k(DType::bf16, {1, 64, 1, d});
  for (Tensor* t : {&q, &k})
    for (int64_t i = 0; i < t->numel(); ++i) t->ptr<uint16_t>()[i] = f32_to_bf16(dist(gen));
  std::vector<uint32_t> a(m * ld), b(np * kKernelTile);
  kernel::bf16::pack_rows(q, 0, 0, 0, m, d, ld, a.data(), m);
  kernel::bf16::pack_tile(k, 0, 0, 0, 50, d, b.data());  // 50 keys, 14 zero columns
  std::vector<float> c(m * kKernelTile);
  const float mul = 0.125f;
  kernel::bf16::scores(m, np, a.data(), ld, b.data(), c.data(), mul);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < kKernelTile; ++j) {
      double exact = 0, bound = 0;
      for (int64_t x = 0; j < 50 && x < d; ++x) {
        const double p = double(widen(q.ptr<uint16_t>()[i * d + x])) *
                         widen(k.ptr<uint16_t>()[j * d + x]);
        exact += p, bound += std::fabs(p);
      }
      EXPECT_LE(std::fabs(c[i * kKernelTile + j] - mul * exact),
                mul * (d * 0x1.0p-24 * bound) + 1e-30)
          << i << " " << j;
    }
}

// A one-hot softmax row has O = V_j, and dS = P (dP - delta) is exactly 0 only if delta adds
// O . dO exactly as the bf16 dP = dO . V_j does.
TEST(Bf16Products, DeltaAddsAsTheBackwardsDp) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  for (const int64_t d : {16, 37, 128}) {
    const int64_t np = kernel::bf16::pairs(d), ld = kernel::bf16::row_words(d);
    std::mt19937 gen(static_cast<uint32_t>(d));
    std::normal_distribution<float> dist(0, 1);
    Tensor g(DType::bf16, {1, 2, 1, d}), v(DType::bf16, {1, 64, 1, d});
    for (Tensor* t : {&g, &v})
      for (int64_t i = 0; i < t->numel(); ++i)
        t->ptr<uint16_t>()[i] = f32_to_bf16(dist(gen) * float(1 << (i % 9)));
    std::vector<uint32_t> a(2 * ld), b(np * kKernelTile);
    kernel::bf16::pack_rows(g, 0, 0, 0, 2, d, ld, a.data(), 2);
    kernel::bf16::pack_tile(v, 0, 0, 0, 64, d, b.data());
    std::vector<float> dp(2 * kKernelTile), o(d), gr(d);
    kernel::bf16::scores(2, np, a.data(), ld, b.data(), dp.data(), 1.0f);
    for (int64_t x = 0; x < d; ++x) gr[x] = widen(g.ptr<uint16_t>()[x]);
    for (int64_t j = 0; j < 64; ++j) {
      for (int64_t x = 0; x < d; ++x) o[x] = widen(v.ptr<uint16_t>()[j * d + x]);
      EXPECT_EQ(kernel::bf16::delta_dot(o.data(), gr.data(), d), dp[j]) << d << " " << j;
    }
  }
}

// bf16 inputs with one-hot softmax rows (|s| ~ 1e6 .. 5e8): the truth is dq = dk = 0, so any
// rounding difference between delta and the bf16 dP (times |K| ~ 1e3) breaks the rule. On both
// outcomes of the choice (the ctest entries kernel_bf16_on / _off).
TEST(Bf16Products, OneHotRowsWithinTheRule) {
  for (const float qk : {1000.0f, 22360.0f})
    for (const int64_t d : {16, 37, 80})
      for (const Mask m : {Mask::none(), Mask::causal_mask()}) {
        test::Case c;
        c.tq = 70, c.tk = 130, c.hq = 2, c.hkv = 1, c.d = d, c.mask = m, c.dtype = DType::bf16;
        c.q_offset = 60, c.qk_scale = qk;
        const std::string err = test::check_case(c, true);
        EXPECT_TRUE(err.empty()) << err;
      }
}

// The AMX-BF16 probe says usable with a measured rate, or why not (cpuid, or Linux refusing
// the tile state, as a guest may); `ctxpar --version`'s products line carries it when measured.
TEST(Bf16Products, AmxProbeMeasuresOrSaysWhyNot) {
  const kernel::AmxProbe amx = kernel::probe_amx();
  if (amx.usable) {
    EXPECT_GT(amx.gflops, 0);
    EXPECT_EQ(amx.why, "");
  } else {
    EXPECT_NE(amx.why, "");
  }
  const kernel::Bf16Choice& c = kernel::bf16_products();
  if (c.reason.find("measured") != std::string::npos)
    EXPECT_NE(c.reason.find("AMX-BF16"), std::string::npos) << c.reason;
}

}  // namespace
}  // namespace ctxpar
