// Lab 16: could fp32 inputs take the AMX tiles (issue 40's fp32 rows)? Each fp32 value x is
// split into three bf16 values h + m + l (each rounded to nearest from what the ones before left,
// as round_to_pairs splits P for the exact bf16 tier), and a product of two fp32 operands is
// summed from the tile products of their parts, as oneDNN's "bf16x3" math mode does:
//   x3 (6)  the six part products that carry the value (h h, h m, m h, h l, m m, l h); the
//           three left out are below 2^-24 of |a b| each;
//   x3 (9)  all nine;
// against the library's fp32 FMA products (gemm_rows, micro<6, 4>), in the forward's two shapes
// with 4 query tiles a task (the fp32 path's), D = 128, the head's 64 key tiles (T = 4096)
// streamed, one thread:
//   S   256 query rows x 64 keys x D  (S = Q K^T: A the query rows' parts, B a key tile's)
//   PV  256 rows x D x 64 keys        (O += P V: A P's parts, B V's VNNI pair-rows)
// Each figure is the median over the repeats by CPU time, in fp32 GFLOP/s (2 m n k a product,
// whatever the tiles do), against the FMA peak measured in the same run, and its worst error on
// the checked entries against fp64 in units of 2^-23 sum |a b| (the bound of a naive fp32 sum is
// k / 2 of them). A measurement for a decision, not a path of the library: the parts' products
// flush bf16 denormals (a part below 2^-126 is 0), so x3 is not fp32's rule for tiny values.
//   ./build/dev/lab_16_fp32_bf16x3 [repeats]
// Exits 0 with a note where AMX-BF16 is not usable (docs/kernel.md, "fp32 products").
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "16_fp32_bf16x3.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <string>
#include <vector>

#include "core/environment.h"
#include "kernel/amx_probe.h"
#include "kernel/lines.h"
#include "kernel/problem.h"
#include "kernel/simd_bf16.h"
#include "kernel/simd_tile.h"
#include "lab_common.h"

#ifndef LAB_16_FP32_BF16X3_ONCE  // defined once, not per target
#define LAB_16_FP32_BF16X3_ONCE
namespace lab {

// x rounded to the nearest bf16 (ties to even; finite inputs only), and back.
inline uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float from_bf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}
// Part i (0, 1, 2) of x: what parts 0..i-1 left, rounded to bf16.
inline uint16_t part(float x, int i) {
  for (int j = 0; j < i; ++j) x -= from_bf16(to_bf16(x));
  return to_bf16(x);
}
inline uint32_t pair(uint16_t lo, uint16_t hi) {
  return static_cast<uint32_t>(lo) | static_cast<uint32_t>(hi) << 16;
}

// C rows [0, 32) x columns [0, 32) (+)= sum of A_i B_j over the (i, j) of `terms` (6: i + j < 3;
// 9: all), npairs (a multiple of 16) pairs, 16 a step: A part i at a + i a_part (rows lda words
// apart), B part j at b + j b_part (pair-rows ldb words apart), C rows ldc floats apart. Tiles
// 0-3 C, 4-5 A, 6-7 B, as the library's gemm_block.
__attribute__((target("amx-tile,amx-bf16"))) void x3_block(int64_t npairs, const uint32_t* a,
                                                           int64_t lda, int64_t a_part,
                                                           const uint32_t* b, int64_t ldb,
                                                           int64_t b_part, float* c, int64_t ldc,
                                                           bool accumulate, int terms) {
  if (accumulate) {
    CTXPAR_TILE_LOAD(0, c, ldc * 4);
    CTXPAR_TILE_LOAD(1, c + 16, ldc * 4);
    CTXPAR_TILE_LOAD(2, c + 16 * ldc, ldc * 4);
    CTXPAR_TILE_LOAD(3, c + 16 * ldc + 16, ldc * 4);
  } else {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t p = 0; p < npairs; p += 16)
    for (int j = 0; j < 3; ++j) {
      const uint32_t* bp = b + j * b_part + p * ldb;
      CTXPAR_TILE_LOAD(6, bp, ldb * 4);
      CTXPAR_TILE_LOAD(7, bp + 16, ldb * 4);
      const int parts = terms == 9 ? 3 : 3 - j;
      for (int i = 0; i < parts; ++i) {
        const uint32_t* ap = a + i * a_part + p;
        CTXPAR_TILE_LOAD(4, ap, lda * 4);
        _tile_dpbf16ps(0, 4, 6);
        _tile_dpbf16ps(1, 4, 7);
        CTXPAR_TILE_LOAD(5, ap + 16 * lda, lda * 4);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
  CTXPAR_TILE_STORE(0, c, ldc * 4);
  CTXPAR_TILE_STORE(1, c + 16, ldc * 4);
  CTXPAR_TILE_STORE(2, c + 16 * ldc, ldc * 4);
  CTXPAR_TILE_STORE(3, c + 16 * ldc + 16, ldc * 4);
}

// C (m x n; both multiples of 32) (+)= the x3 product, 32 x 32 blocks, rows outer.
__attribute__((target("amx-tile,amx-bf16"))) void x3_gemm(int64_t m, int64_t n, int64_t npairs,
                                                          const uint32_t* a, int64_t lda,
                                                          int64_t a_part, const uint32_t* b,
                                                          int64_t ldb, int64_t b_part, float* c,
                                                          int64_t ldc, bool accumulate, int terms) {
  ctxpar::kernel::load_tile_config(ctxpar::kernel::kTiles16x64);
  for (int64_t r = 0; r < m; r += 32)
    for (int64_t col = 0; col < n; col += 32)
      x3_block(npairs, a + r * lda, lda, a_part, b + col, ldb, b_part, c + r * ldc + col, ldc,
               accumulate, terms);
  _tile_release();
}
}  // namespace lab
#endif

HWY_BEFORE_NAMESPACE();
namespace lab::HWY_NAMESPACE {
using namespace ctxpar::kernel::HWY_NAMESPACE;
using ctxpar::kernel::kernel_k_panel;
using ctxpar::kernel::LineVector;

std::vector<Figure> Run(int repeats) {
  const int64_t nl = lanes(), d = 128, ld = padded_ld(round_up(d, nl)), rows = 256;
  const int64_t nkt = 64;                       // key tiles of a head streamed (T = 4096)
  const int64_t dpairs = d / 2, ldw = 80;       // Q's pairs a row: 64, one line of padding
  const int64_t kpairs = kTile / 2, ldv = 144;  // P's pairs a row; V's pair-rows, padded
  // Values of a normal-like spread (sums of uniforms), fp32.
  auto fill = [](LineVector<float>& v, unsigned seed) {
    uint64_t s = seed * 0x9E3779B97F4A7C15ull + 1;
    for (size_t i = 0; i < v.size(); ++i) {
      double x = 0;
      for (int j = 0; j < 4; ++j) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        x += static_cast<double>(s >> 11) * 0x1p-53 - 0.5;
      }
      v[i] = static_cast<float>(x * 1.7);
    }
  };
  // fp32 operands as the library packs them: Q rows [rows][ld], K^T tiles [nkt][d][64], P
  // [rows][64], V tiles [nkt][64][ld], O [rows][ld].
  LineVector<float> q(rows * ld), kt(nkt * d * kTile), p(rows * kTile), v(nkt * kTile * ld),
      s(rows * kTile), o(rows * ld), m(rows), lv(rows * nl), o32;
  fill(q, 1), fill(kt, 2), fill(p, 3), fill(v, 4);
  for (float& x : p) x = std::fabs(x) * 0.3f;  // P in [0, 1]
  // Their three parts: Q's pairs [3][rows][ldw], K's key tiles [nkt][3][dpairs][64], P's pairs
  // [3][rows][kpairs], V's VNNI pair-rows [nkt][3][kpairs][ldv].
  LineVector<uint32_t> q3(3 * rows * ldw, 0u), k3(nkt * 3 * dpairs * kTile, 0u),
      p3(3 * rows * kpairs, 0u), pl3(3 * rows * kpairs, 0u), v3(nkt * 3 * kpairs * ldv, 0u);
  for (int i = 0; i < 3; ++i) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < dpairs; ++x)
        q3[(i * rows + r) * ldw + x] =
            pair(part(q[r * ld + 2 * x], i), part(q[r * ld + 2 * x + 1], i));
    for (int64_t t = 0; t < nkt; ++t)
      for (int64_t x = 0; x < dpairs; ++x)
        for (int64_t c = 0; c < kTile; ++c)
          k3[((t * 3 + i) * dpairs + x) * kTile + c] =
              pair(part(kt[(t * d + 2 * x) * kTile + c], i),
                   part(kt[(t * d + 2 * x + 1) * kTile + c], i));
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t x = 0; x < kpairs; ++x)
        p3[(i * rows + r) * kpairs + x] =
            pair(part(p[r * kTile + 2 * x], i), part(p[r * kTile + 2 * x + 1], i));
    for (int64_t t = 0; t < nkt; ++t)
      for (int64_t x = 0; x < kpairs; ++x)
        for (int64_t c = 0; c < d; ++c)
          v3[((t * 3 + i) * kpairs + x) * ldv + c] =
              pair(part(v[(t * kTile + 2 * x) * ld + c], i),
                   part(v[(t * kTile + 2 * x + 1) * ld + c], i));
  }
  const double flops = 2.0 * nkt * rows * kTile * d;
  std::vector<Figure> out = {
      {"S, fp32 FMAs (the library's)", flops, {}}, {"S, x3 (6 products)", flops, {}},
      {"S, x3 (9 products)", flops, {}},           {"PV, fp32 FMAs (the library's)", flops, {}},
      {"PV, x3 (6 products)", flops, {}},          {"PV, x3 (9 products)", flops, {}},
      {"loop, fp32 FMAs", 2 * flops, {}},          {"loop, x3 (6 products)", 2 * flops, {}}};
  const int64_t k_panel = kernel_k_panel(kTile, d, 0), last = nkt - 1;
  // One figure: an untimed pass over the head's key tiles, then a timed one (as lab 15), then
  // the last tile's product checked.
  auto timed = [&](Figure& f, auto&& tile, auto&& err) {
    double t0 = 0;
    for (int pass = 0; pass < 2; ++pass) {
      t0 = cpu_seconds();
      for (int64_t t = 0; t < nkt; ++t) tile(t);
    }
    f.seconds.push_back(cpu_seconds() - t0);
    f.max_err = std::max(f.max_err, err());
  };
  for (int rep = 0; rep < repeats; ++rep) {
    auto s_err = [&] {
      return product_error(4, d, q.data(), ld, kt.data() + last * d * kTile, kTile, s.data(),
                           kTile);
    };
    timed(
        out[0],
        [&](int64_t t) {
          gemm_rows(rows, kTile, d, q.data(), ld, kt.data() + t * d * kTile, kTile, s.data(), kTile,
                    false, k_panel);
        },
        s_err);
    for (int terms : {6, 9})
      timed(
          out[terms == 6 ? 1 : 2],
          [&](int64_t t) {
            x3_gemm(rows, kTile, dpairs, q3.data(), ldw, rows * ldw,
                    k3.data() + t * 3 * dpairs * kTile, kTile, dpairs * kTile, s.data(), kTile,
                    false, terms);
          },
          s_err);
    // P V accumulates into O: each figure's check is of O's first rows after one product from
    // O = 0 with the last V tile, so the timed passes' sums do not enter it.
    auto pv_err = [&](auto&& one) {
      return [&, one] {
        std::fill(o.begin(), o.end(), 0.0f);
        one(last);
        return product_error(4, kTile, p.data(), kTile, v.data() + last * kTile * ld, ld, o.data(),
                             ld);
      };
    };
    auto pv32 = [&](int64_t t) {
      gemm_rows(rows, d, kTile, p.data(), kTile, v.data() + t * kTile * ld, ld, o.data(), ld, true);
    };
    timed(out[3], pv32, pv_err(pv32));
    for (int terms : {6, 9}) {
      auto pvx3 = [&, terms](int64_t t) {
        x3_gemm(rows, d, kpairs, p3.data(), kpairs, rows * kpairs, v3.data() + t * 3 * kpairs * ldv,
                ldv, kpairs * ldv, o.data(), ld, true, terms);
      };
      timed(out[terms == 6 ? 4 : 5], pvx3, pv_err(pvx3));
    }
    // The forward's loop over the head's key tiles, one tile an online-softmax step (the fp32
    // path's): S, the library's softmax (softmax_row: max, exponentials, rescale), then O += P V;
    // x3 splits P in three parts first (the library's round_to_pairs, as the exact bf16 tier).
    // Checked: the O rows of both loops agree with each other within the bound.
    for (int x3 = 0; x3 <= 1; ++x3) {
      auto fresh = [&] {
        std::fill(o.begin(), o.end(), 0.0f);
        std::fill(m.begin(), m.end(), -INFINITY);
        std::fill(lv.begin(), lv.end(), 0.0f);
      };
      auto tile = [&](int64_t t) {
        if (x3)
          x3_gemm(rows, kTile, dpairs, q3.data(), ldw, rows * ldw,
                  k3.data() + t * 3 * dpairs * kTile, kTile, dpairs * kTile, s.data(), kTile, false,
                  6);
        else
          gemm_rows(rows, kTile, d, q.data(), ld, kt.data() + t * d * kTile, kTile, s.data(), kTile,
                    false, k_panel);
        for (int64_t r = 0; r < rows; ++r)
          softmax_row<false>(s.data() + r * kTile, m[r], lv.data() + r * nl, o.data() + r * ld, d,
                             nullptr);
        if (x3) {
          ctxpar::kernel::bf16::round_to_pairs(s.data(), kTile, rows, kpairs, pl3.data(), kpairs, 3,
                                               rows * kpairs);
          x3_gemm(rows, d, kpairs, pl3.data(), kpairs, rows * kpairs,
                  v3.data() + t * 3 * kpairs * ldv, ldv, kpairs * ldv, o.data(), ld, true, 6);
        } else {
          gemm_rows(rows, d, kTile, s.data(), kTile, v.data() + t * kTile * ld, ld, o.data(), ld,
                    true);
        }
      };
      double t0 = 0;
      for (int pass = 0; pass < 2; ++pass) {
        fresh();
        t0 = cpu_seconds();
        for (int64_t t = 0; t < nkt; ++t) tile(t);
      }
      out[6 + x3].seconds.push_back(cpu_seconds() - t0);
      if (x3 == 0) {
        o32.assign(o.begin(), o.end());
      } else {  // |O x3 - O fp32| / (2^-23 max |O|) over the first 4 rows
        double worst = 0, mag = 0;
        for (int64_t i = 0; i < 4 * ld; ++i) mag = std::max(mag, std::fabs(double(o32[i])));
        for (int64_t i = 0; i < 4 * ld; ++i)
          worst = std::max(worst, std::fabs(double(o[i]) - o32[i]) / (mag * 0x1p-23));
        out[7].max_err = std::max(out[7].max_err, worst);
      }
    }
  }
  return out;
}

}  // namespace lab::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "kernel/peak.h"

namespace lab {
HWY_EXPORT(Run);
}  // namespace lab

int main(int argc, char** argv) {
  int repeats = 0;
  if (!lab::repeats_arg(argc, argv, "lab_16_fp32_bf16x3", 5, repeats)) return 2;
  if (!lab::amx_usable_or_say_why()) return 0;
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_SIMD
  ctxpar::kernel::select_simd_target();
  const double peak = ctxpar::kernel::measure_fma_peak(1).cpu_gflops;
  const std::vector<lab::Figure> figs = HWY_DYNAMIC_DISPATCH(lab::Run)(repeats);
  std::printf("lab_16_fp32_bf16x3: SIMD %s, one thread, median of %d by CPU time\n",
              ctxpar::kernel::simd_target_name(), repeats);
  std::printf("  FMA peak (register-only chains)   %7.1f GFLOP/s\n", peak);
  // A sum of k <= 128 products: within k / 2 units (the naive fp32 sum's bound); a missing
  // part product (2^-8 of |a b|) exceeds it by orders of magnitude. The x3 loop's O against
  // the fp32 loop's: sums over T = 4096 keys, k / 2 = 2048 units.
  const bool ok = lab::print_figures(figs, peak, [](const lab::Figure& f) {
    return f.name.rfind("loop", 0) == 0 ? 2048.0 : 64.0;
  });
  return ok ? 0 : 1;
}
#endif  // HWY_ONCE
