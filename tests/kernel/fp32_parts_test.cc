// KernelConfig::fp32_products = parts (Note [fp32 through three bf16 parts], src/kernel/amx_bf16.cc):
// fp32 q, k, v whose S = Q K^T (forward and backward) and P V (forward) run through AMX tiles on
// three bf16 parts of each value. Against fp64 by the fp32 rule (kernel_support.h), where this
// machine takes it; where it does not (no usable AMX-BF16, or a SIMD target below avx512: the
// ctest entries kernel_avx2 ... run this binary there too), the call is refused naming why.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kernel/kernel_support.h"
#include "kernel/lines.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"

namespace ctxpar::test {
namespace {

bool parts_taken() { return kernel::fp32_parts_refusal().empty(); }

float widen(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// The split itself: 3 parts that add up to the value exactly (in double), for values over
// fp32's normal range down to 2^-100, the third part of a value below about 2^-102 flushed.
TEST(Fp32Parts, PartsAddUpToTheValue) {
  if (!parts_taken())
    GTEST_SKIP() << kernel::fp32_parts_refusal();     // (the split needs AVX512_BF16)
  const int64_t rows = 6, d = 40, ldb = 48, np = 32;  // 3 pair-rows; d not a multiple of 16
  std::vector<float> x(rows * d);
  uint64_t s = 7;
  for (float& v : x) {
    s = s * 6364136223846793005ull + 1442695040888963407ull;
    const double m = 1 + static_cast<double>(s >> 40) * 0x1p-24;
    const int e = static_cast<int>((s >> 8) % 200) - 100;  // 2^-100 .. 2^99
    v = static_cast<float>(std::ldexp(s & 1 ? m : -m, e));
  }
  kernel::LineVector<uint32_t> vnni(3 * rows / 2 * ldb, 0xdeadbeefu);
  kernel::bf16::split_vnni(x.data(), d, rows, d, ldb, vnni.data(), rows / 2 * ldb);
  // The same values as rows of pairs (Q's layout, round_to_pairs' split).
  kernel::LineVector<uint32_t> pairs(3 * rows * np, 0u);
  std::vector<float> padded(rows * 2 * np, 0.0f);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) padded[r * 2 * np + c] = x[r * d + c];
  kernel::bf16::round_to_pairs(padded.data(), 2 * np, rows, np, pairs.data(), np, 3, rows * np);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < d; ++c) {
      double from_vnni = 0, from_pairs = 0;
      for (int i = 0; i < 3; ++i) {
        const uint32_t w = vnni[i * rows / 2 * ldb + r / 2 * ldb + c];
        from_vnni += widen(static_cast<uint16_t>(r % 2 == 0 ? w & 0xffff : w >> 16));
        const uint32_t p = pairs[i * rows * np + r * np + c / 2];
        from_pairs += widen(static_cast<uint16_t>(c % 2 == 0 ? p & 0xffff : p >> 16));
      }
      const double v = x[r * d + c];
      // Exact where the third part is a normal bf16 (|x| >= 2^-110 covers it with room).
      const double bound = std::fabs(v) >= 0x1p-110 ? 0 : 0x1p-126;
      EXPECT_LE(std::fabs(from_vnni - v), bound) << "row " << r << " col " << c << " x " << v;
      EXPECT_LE(std::fabs(from_pairs - v), bound) << "row " << r << " col " << c << " x " << v;
    }
  // Columns past d are not written (the caller zeroes them).
  EXPECT_EQ(vnni[d], 0xdeadbeefu);
}

std::vector<Case> parts_cases() {
  std::vector<Case> cases;
  Mask window = Mask::causal_mask();
  window.window_left = 50;
  for (int64_t d : {16, 64, 80, 128})
    for (Mask m : {Mask::none(), Mask::causal_mask(), window}) {
      Case c;
      c.tq = 150, c.tk = 190, c.hq = 4, c.hkv = 2, c.d = d, c.mask = m;  // ragged, grouped
      c.q_offset = 40, c.fp32 = Fp32Products::parts;
      cases.push_back(c);
    }
  Case two;  // two threads, documents
  two.tq = two.tk = 300, two.hq = two.hkv = 2, two.d = 64, two.threads = 2, two.doc_len = 70;
  two.mask = Mask::causal_mask(), two.mask.documents = true, two.fp32 = Fp32Products::parts;
  cases.push_back(two);
  return cases;
}

// Forward and backward against fp64 by the fp32 rule, and the results are not the FMA path's
// bits (the parts were taken).
TEST(Fp32Parts, WithinTheFp32Rule) {
  if (!parts_taken()) GTEST_SKIP() << kernel::fp32_parts_refusal();
  for (const Case& c : parts_cases()) {
    const std::string err = check_case(c, true);
    EXPECT_TRUE(err.empty()) << err;
  }
  Case c = parts_cases()[3];
  const Inputs in = make_inputs(c);
  KernelConfig fma, parts;
  fma.fp32_products = Fp32Products::fma, parts.fp32_products = Fp32Products::parts;
  const Outputs a = run_fast(in, c.mask, 1, false, 1, {}, fma);
  const Outputs b = run_fast(in, c.mask, 1, false, 1, {}, parts);
  EXPECT_NE(std::memcmp(a.o.ptr<float>(), b.o.ptr<float>(), a.o.numel() * sizeof(float)), 0)
      << "fp32_products = parts gave the FMA path's bits: the parts were not taken";
}

// The backward recomputes S through the same parts, so P = exp(S - LSE) never exceeds 1 at
// logits where an ulp of S is large (Note [P at most one]); with the FMA S it did (dq ~ 1e7).
TEST(Fp32Parts, ExtremeLogitsKeepTheForwardsScores) {
  if (!parts_taken()) GTEST_SKIP() << kernel::fp32_parts_refusal();
  for (float qk : {100.0f, 1000.0f, 22360.0f})  // |s| ~ 1e4, 1e6, 5e8
    for (Mask m : {Mask::none(), Mask::causal_mask()}) {
      Case c;
      c.tq = 70, c.tk = 130, c.hq = 2, c.hkv = 1, c.d = 64, c.mask = m, c.q_offset = 60;
      c.qk_scale = qk, c.fp32 = Fp32Products::parts;
      const std::string err = check_case(c, true);
      EXPECT_TRUE(err.empty()) << err;
    }
}

// Where this machine cannot take parts, asking for them is an error naming the setting and why
// (never a silent fall back to FMAs); where it can, fma still gives the FMA path.
TEST(Fp32Parts, RefusedNamingWhyWhereNotTaken) {
  Case c;
  c.tq = c.tk = 20, c.d = 32, c.fp32 = Fp32Products::parts;
  const Inputs in = make_inputs(c);
  KernelConfig config;
  config.fp32_products = Fp32Products::parts;
  if (parts_taken()) {
    EXPECT_NO_THROW(run_fast(in, c.mask, 1, true, 1, {}, config));
    return;
  }
  if (kernel::use_scalar_path()) return;  // the scalar path ignores it (its own FMAs)
  try {
    run_fast(in, c.mask, 1, false, 1, {}, config);
    ADD_FAILURE() << "fp32_products = parts was not refused: " << kernel::fp32_parts_refusal();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("fp32_products = parts"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace ctxpar::test
