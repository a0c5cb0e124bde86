// The exact bf16 products (kernel/simd_bf16.h; AMX tiles: kernel/amx_bf16.cc). The
// fp64 reference tests of this binary run on every outcome (ctest entries kernel_bf16_on /
// kernel_bf16_off / kernel_bf16_amx force them; AmxProducts.* skip, saying why, where AMX-BF16
// is not usable); these
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
#include "kernel/amx_forced.h"
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
  if (want == "off") {
    EXPECT_EQ(kernel::bf16_products_on(KernelConfig{}), kernel::kBf16Fp32);
  }
  if (want == "on" && cpu_has_bf16()) {
    EXPECT_EQ(kernel::bf16_products_on(KernelConfig{}),
              avx512 ? kernel::kBf16Dot : kernel::kBf16Fp32)
        << t.chosen;
    if (!avx512) {
      EXPECT_NE(t.products.find("not applied"), std::string::npos) << t.products;
    }
  }
  if (want == "amx" && kernel::amx_unusable_why().empty()) {
    EXPECT_EQ(kernel::bf16_products_on(KernelConfig{}),
              avx512 ? kernel::kBf16Amx : kernel::kBf16Fp32)
        << t.chosen;
  }
  if (!cpu_has_bf16() && want != "amx") {
    EXPECT_EQ(kernel::bf16_products().level, kernel::kBf16Fp32);
  }
}

// C = mul * (A B) over bf16 pairs (vdpbf16ps, or AMX tiles with `amx`), m rows: every
// product exact, the sums fp32 (error within the fp32 bound n u sum |a b| of a sequential sum),
// 50 keys of 64 (zero columns). Returns "" or the first element out of the bound.
std::string check_scores(bool amx, int64_t d, int64_t m) {
  const int64_t np = kernel::bf16::stored_pairs(d, amx), ld = kernel::bf16::row_words(d, amx);
  std::mt19937 gen(static_cast<uint32_t>(d * 1000 + m));
  std::normal_distribution<float> dist(0, 1);
  Tensor q(DType::bf16, {1, m, 1, d}), k(DType::bf16, {1, 64, 1, d});
  for (Tensor* t : {&q, &k})
    for (int64_t i = 0; i < t->numel(); ++i) t->ptr<uint16_t>()[i] = f32_to_bf16(dist(gen));
  std::vector<uint32_t> a(m * ld), b(np * kKernelTile);
  kernel::bf16::pack_rows(q, 0, 0, 0, m, d, ld, a.data(), m);
  kernel::bf16::pack_tile(k, 0, 0, 0, 50, d, b.data(), amx);  // 50 keys, 14 zero columns
  std::vector<float> c(m * kKernelTile, -1.0f);
  const float mul = 0.125f;
  kernel::bf16::scores(m, np, a.data(), ld, b.data(), c.data(), mul, amx);
  for (int64_t i = 0; i < m; ++i)
    for (int64_t j = 0; j < kKernelTile; ++j) {
      double exact = 0, bound = 0;
      for (int64_t x = 0; j < 50 && x < d; ++x) {
        const double p =
            double(widen(q.ptr<uint16_t>()[i * d + x])) * widen(k.ptr<uint16_t>()[j * d + x]);
        exact += p, bound += std::fabs(p);
      }
      if (!(std::fabs(c[i * kKernelTile + j] - mul * exact) <=
            mul * (d * 0x1.0p-24 * bound) + 1e-30))
        return "D " + std::to_string(d) + " m " + std::to_string(m) + ": row " + std::to_string(i) +
               " col " + std::to_string(j) + " = " + std::to_string(c[i * kKernelTile + j]) +
               ", exact " + std::to_string(mul * exact);
    }
  return "";
}

// Note [Packing by vectors] (simd_bf16.cc): the AVX-512 packers write the words of the loops
// they replace (pack_tile_words, pack_vnni_words: word [p][c] = (x[c][2p], x[c][2p + 1]); word
// [r / 2][c] = (x[r][c], x[r + 1][c])), zeros included, for odd and even D, ragged tiles and
// a strided head of a [B, T, H, D] tensor, into buffers that held garbage.
TEST(Bf16Products, PackingByVectorsWritesTheLoopsWords) {
  __builtin_cpu_init();
  if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")))
    GTEST_SKIP() << "no AVX-512BW: pack_tile and pack_vnni are the word loops themselves here";
  std::mt19937 gen(29);
  for (int64_t d : {1, 3, 16, 37, 64, 80, 128, 130}) {
    Tensor x(DType::bf16, {2, 150, 3, d});
    for (int64_t i = 0; i < x.numel(); ++i) x.ptr<uint16_t>()[i] = static_cast<uint16_t>(gen());
    for (bool amx : {false, true})
      for (int64_t cols : {1, 15, 16, 17, 50, 64}) {
        const int64_t words = kernel::bf16::stored_pairs(d, amx) * kKernelTile;
        std::vector<uint32_t> got(words, 0xdeadbeefu), want(words, 0x12345678u);
        kernel::bf16::pack_tile(x, 1, 2, 83, cols, d, got.data(), amx);
        kernel::bf16::pack_tile_words(x, 1, 2, 83, cols, d, want.data(), amx);
        EXPECT_EQ(got, want) << "pack_tile D " << d << " cols " << cols << " amx " << amx;
      }
    const int64_t ldb = kernel::bf16::vnni_words(d);
    for (int64_t rows : {1, 2, 31, 33, 63, 64}) {
      std::vector<uint32_t> got(32 * ldb, 0xdeadbeefu), want(32 * ldb, 0x12345678u);
      kernel::bf16::pack_vnni(x, 1, 1, 77, rows, d, ldb, got.data(), kKernelTile);
      kernel::bf16::pack_vnni_words(x, 1, 1, 77, rows, d, ldb, want.data(), kKernelTile);
      EXPECT_EQ(got, want) << "pack_vnni D " << d << " rows " << rows;
    }
  }
}

TEST(Bf16Products, ScoresAreExactProductsSummedInFp32) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  EXPECT_EQ(check_scores(false, 101, 10), "");  // D odd: a zero half pair
}

// Through AMX tiles: row counts below, between and above the 16-row tiles, D odd and not a
// multiple of 32 (zero pairs pad the tiles to 16 pairs deep).
TEST(AmxProducts, ScoresAreExactProductsSummedInFp32) {
  CTXPAR_SKIP_WITHOUT_AMX();
  for (const int64_t d : {37, 80, 128})
    for (const int64_t m : {2, 10, 33, 64, 100}) EXPECT_EQ(check_scores(true, d, m), "");
}

// A one-hot softmax row has O = V_j, and dS = P (dP - delta) is exactly 0 only if delta adds
// O . dO exactly as the bf16 dP = dO . V_j does (vdpbf16ps, or AMX tiles with `amx`).
void check_delta(bool amx, int64_t d) {
  const int64_t np = kernel::bf16::stored_pairs(d, amx), ld = kernel::bf16::row_words(d, amx);
  std::mt19937 gen(static_cast<uint32_t>(d));
  std::normal_distribution<float> dist(0, 1);
  Tensor g(DType::bf16, {1, 2, 1, d}), v(DType::bf16, {1, 64, 1, d});
  for (Tensor* t : {&g, &v})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->ptr<uint16_t>()[i] = f32_to_bf16(dist(gen) * float(1 << (i % 9)));
  std::vector<uint32_t> a(2 * ld), b(np * kKernelTile);
  kernel::bf16::pack_rows(g, 0, 0, 0, 2, d, ld, a.data(), 2);
  kernel::bf16::pack_tile(v, 0, 0, 0, 64, d, b.data(), amx);
  std::vector<float> dp(2 * kKernelTile), o(d), gr(d);
  kernel::bf16::scores(2, np, a.data(), ld, b.data(), dp.data(), 1.0f, amx);
  for (int64_t x = 0; x < d; ++x) gr[x] = widen(g.ptr<uint16_t>()[x]);
  for (int64_t j = 0; j < 64; ++j) {
    for (int64_t x = 0; x < d; ++x) o[x] = widen(v.ptr<uint16_t>()[j * d + x]);
    EXPECT_EQ(kernel::bf16::delta_dot(o.data(), gr.data(), d, amx), dp[j]) << d << " " << j;
  }
}

TEST(Bf16Products, DeltaAddsAsTheBackwardsDp) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  for (const int64_t d : {16, 37, 128}) check_delta(false, d);
}

TEST(AmxProducts, DeltaAddsAsTheBackwardsDp) {
  CTXPAR_SKIP_WITHOUT_AMX();
  for (const int64_t d : {16, 37, 80, 128}) check_delta(true, d);
}

// bf16 inputs with one-hot softmax rows (|s| ~ 1e6 .. 5e8): the truth is dq = dk = 0, so any
// rounding difference between delta and the bf16 dP (times |K| ~ 1e3) breaks the rule. On both
// outcomes of the choice (the ctest entries kernel_bf16_on / _off).
TEST(Bf16Products, OneHotRowsWithinTheRule) {
  for (const float qk : {1000.0f, 22360.0f})
    for (const int64_t d : {16, 37, 80})
      for (const Mask& m : {Mask::none(), Mask::causal_mask()}) {
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
  if (c.reason.find("measured") != std::string::npos) {
    EXPECT_NE(c.reason.find("AMX-BF16"), std::string::npos) << c.reason;
  }
}

// round_to_pairs (Note [P V, dV, dK, dQ through AMX] in amx_bf16.cc): one part is each value
// rounded to nearest even, as round_to_bf16; three parts add up to the fp32 value exactly
// (every significand bit kept), over values from 2^-100 to 2^100 of both signs, in row order,
// with a row tail past the 16-pair vectors.
TEST(AmxProducts, ThreeBf16PartsAddUpToTheFp32ValueExactly) {
  CTXPAR_SKIP_WITHOUT_AMX();
  std::mt19937 rng(7);
  std::uniform_real_distribution<float> mant(1.0f, 2.0f);
  std::uniform_int_distribution<int> expo(-100, 100);
  const int64_t rows = 3, npairs = 19, ldx = 2 * npairs + 2, ldw = npairs + 1;
  const int64_t split = rows * ldw;
  std::vector<float> x(rows * ldx);
  for (float& v : x) v = std::ldexp(mant(rng), expo(rng)) * (rng() % 2 ? 1.0f : -1.0f);
  x[5] = 1.0f + 0x1.0p-23f, x[6] = -(1.0f + 0x1.ffp-9f);  // the lowest bit; a tie region
  std::vector<uint32_t> one(split, 0u), three(3 * split, 0u);
  kernel::bf16::round_to_pairs(x.data(), ldx, rows, npairs, one.data(), ldw);
  kernel::bf16::round_to_pairs(x.data(), ldx, rows, npairs, three.data(), ldw, 3, split);
  auto half = [](uint32_t w, int64_t i) { return widen(static_cast<uint16_t>(w >> (16 * i))); };
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < 2 * npairs; ++c) {
      const float v = x[r * ldx + c];
      const int64_t w = r * ldw + c / 2;
      EXPECT_EQ(half(one[w], c % 2), round_to_bf16(v)) << r << " " << c;
      const double sum = static_cast<double>(half(three[w], c % 2)) +
                         half(three[split + w], c % 2) + half(three[2 * split + w], c % 2);
      EXPECT_EQ(sum, static_cast<double>(v)) << r << " " << c << " " << v;
    }
}

// gemm_dot (the fast tier's P V, dV, dK, dQ through vdpbf16ps; gemm_pairs without amx) against
// an fp64 sum: small integers (bf16 values, every partial sum exact in fp32), so C must come out
// equal; rows in 6 / 4 / 2 blocks, 16 to 96 columns (1 to 4 vectors, a second 64-column pass),
// strides past the data, C zeroed or accumulated.
TEST(Bf16Products, GemmDotIsTheExactPairProducts) {
  if (!cpu_has_bf16()) GTEST_SKIP() << "this CPU has no AVX512_BF16";
  std::mt19937 rng(5);
  std::uniform_int_distribution<int> small(-8, 8);
  auto bf = [](int v) {  // |v| <= 8: a bf16 value, its fp32 bits' high half
    const float f = static_cast<float>(v);
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u >> 16;
  };
  for (const int64_t m : {2, 4, 6, 10, 16})
    for (const int64_t n : {16, 32, 48, 64, 80, 96})
      for (const bool accumulate : {false, true}) {
        const int64_t npairs = 7, lda = npairs + 3, ldb = n + 16, ldc = n + 5;
        std::vector<int> av(m * 2 * npairs), bv(2 * npairs * n);
        for (int& v : av) v = small(rng);
        for (int& v : bv) v = small(rng);
        std::vector<uint32_t> a(m * lda, 0u), b(npairs * ldb, 0u);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t p = 0; p < npairs; ++p)
            a[r * lda + p] = bf(av[r * 2 * npairs + 2 * p]) | bf(av[r * 2 * npairs + 2 * p + 1])
                                                                  << 16;
        for (int64_t p = 0; p < npairs; ++p)
          for (int64_t c = 0; c < n; ++c)
            b[p * ldb + c] = bf(bv[2 * p * n + c]) | bf(bv[(2 * p + 1) * n + c]) << 16;
        std::vector<float> c(m * ldc);
        for (int64_t i = 0; i < m * ldc; ++i) c[i] = static_cast<float>(i % 13) - 6;
        const std::vector<float> before = c;
        kernel::bf16::gemm_pairs(m, n, npairs, a.data(), lda, b.data(), ldb, c.data(), ldc,
                                 accumulate, false);
        for (int64_t r = 0; r < m; ++r)
          for (int64_t col = 0; col < ldc; ++col) {
            if (col >= n) {  // columns past n untouched
              EXPECT_EQ(c[r * ldc + col], before[r * ldc + col]);
              continue;
            }
            double want = accumulate ? before[r * ldc + col] : 0.0;
            for (int64_t k = 0; k < 2 * npairs; ++k)
              want += static_cast<double>(av[r * 2 * npairs + k]) * bv[k * n + col];
            EXPECT_EQ(c[r * ldc + col], want) << m << "x" << n << " " << r << "," << col;
          }
      }
}

// gemm_amx_chunks (the backward's deeper tile products, Note [Deeper tile products]): B's
// chunks in separate buffers, A's chunks a_chunk words apart, 1 and 3 parts, C zeroed or
// accumulated. (1) Random bf16 values, where the order of the fp32 additions shows in the bits: C
// equals, bit for bit, successive gemm_amx calls of one chunk each (what the backward made before,
// so its results keep their bits). (2) Small integers, every sum exact in fp32: C equals the fp64
// sum over every chunk, part and pair.
TEST(AmxProducts, ChunkedProductAddsAsSuccessiveOneChunkProducts) {
  CTXPAR_SKIP_WITHOUT_AMX();
  std::mt19937 rng(11);
  std::uniform_real_distribution<float> value(-2.0f, 2.0f);
  std::uniform_int_distribution<int> small(-8, 8);
  auto bf = [](float f) {  // f's bf16 by truncation: any bf16 value will do
    uint32_t u;
    std::memcpy(&u, &f, sizeof u);
    return u >> 16;
  };
  for (const bool integers : {false, true})
    for (const int nsplit : {1, 3})
      for (const int64_t nchunks : {1, 2, 4})
        for (const bool accumulate : {false, true}) {
          const int64_t m = 48, n = 80, chunk_pairs = 32, lda = chunk_pairs + 16, ldb = n + 16;
          const int64_t ldc = n + 5, split = m * lda, a_chunk = nsplit * split + 16;
          auto draw = [&] {
            const float f = integers ? static_cast<float>(small(rng)) : value(rng);
            return bf(f) | bf(integers ? static_cast<float>(small(rng)) : value(rng)) << 16;
          };
          std::vector<uint32_t> a(nchunks * a_chunk);
          for (uint32_t& w : a) w = draw();
          std::vector<std::vector<uint32_t>> b(nchunks);
          std::vector<const uint32_t*> bp;
          for (std::vector<uint32_t>& chunk : b) {
            chunk.resize(chunk_pairs * ldb);
            for (uint32_t& w : chunk) w = draw();
            bp.push_back(chunk.data());
          }
          std::vector<float> c0(m * ldc);
          for (int64_t i = 0; i < m * ldc; ++i) c0[i] = static_cast<float>(i % 13) - 6;
          std::vector<float> c = c0, successive = c0;
          kernel::bf16::gemm_amx_chunks(m, n, nchunks, chunk_pairs, a.data(), lda, a_chunk,
                                        bp.data(), ldb, c.data(), ldc, accumulate, nsplit, split);
          for (int64_t i = 0; i < nchunks; ++i)
            kernel::bf16::gemm_amx(m, n, chunk_pairs, a.data() + i * a_chunk, lda, bp[i], ldb,
                                   successive.data(), ldc, accumulate || i > 0, nsplit, split);
          const std::string where = std::string(integers ? "integers" : "random") + ", parts " +
                                    std::to_string(nsplit) + ", chunks " + std::to_string(nchunks) +
                                    (accumulate ? ", accumulated" : "");
          EXPECT_EQ(std::memcmp(c.data(), successive.data(), c.size() * sizeof(float)), 0) << where;
          if (!integers) continue;
          auto half = [](uint32_t w, int k) { return widen(static_cast<uint16_t>(w >> (16 * k))); };
          for (int64_t r = 0; r < m; ++r)
            for (int64_t col = 0; col < n; ++col) {
              double want = accumulate ? c0[r * ldc + col] : 0.0;
              for (int64_t i = 0; i < nchunks; ++i)
                for (int sp = 0; sp < nsplit; ++sp)
                  for (int64_t p = 0; p < chunk_pairs; ++p)
                    for (int k = 0; k < 2; ++k)
                      want +=
                          static_cast<double>(half(a[i * a_chunk + sp * split + r * lda + p], k)) *
                          half(b[i][p * ldb + col], k);
              ASSERT_EQ(c[r * ldc + col], want) << where << " at " << r << "," << col;
            }
        }
}

using test::AmxForced;  // the AMX products for the test's kernel calls (amx_forced.h)

// Forward and backward against the fp64 reference by the fp32 rule (bf16 inputs): causal,
// window and document masks, D = 64, 80, 96, 128, lengths not multiples of 16, GQA, 2 threads
// (every OpenMP thread loads its tile configuration).
TEST_F(AmxForced, ForwardBackwardWithinTheRule) {
  using test::Case;
  Mask window, docs;
  window.window_left = 40, window.window_right = 7;
  docs.causal = docs.documents = true;
  const Mask masks[] = {Mask::causal_mask(), window, docs};
  int n = 0;
  for (const int64_t d : {64, 80, 96, 128})
    for (const Mask& m : masks) {
      Case c;
      c.tq = 150 - 7 * n % 3, c.tk = 150, c.hq = 2, c.hkv = 1, c.d = d, c.mask = m;
      c.dtype = DType::bf16, c.doc_len = 45, c.threads = 1 + n % 2, c.seed = 11 + n++;
      c.products = kProducts;
      const std::string err = test::check_case(c, true);
      EXPECT_TRUE(err.empty()) << err;
    }
}

// One-hot softmax rows (|s| ~ 1e6 .. 5e8): dq = dk = 0 is the truth, so delta must add as the
// AMX dP does (else |K| ~ 1e3 amplifies the difference past the rule).
TEST_F(AmxForced, OneHotRowsWithinTheRule) {
  for (const float qk : {1000.0f, 22360.0f})
    for (const int64_t d : {16, 37, 80}) {
      test::Case c;
      c.tq = 70, c.tk = 130, c.hq = 2, c.hkv = 1, c.d = d, c.mask = Mask::causal_mask();
      c.dtype = DType::bf16, c.q_offset = 60, c.qk_scale = qk, c.products = kProducts;
      const std::string err = test::check_case(c, true);
      EXPECT_TRUE(err.empty()) << err;
    }
}

}  // namespace
}  // namespace ctxpar
