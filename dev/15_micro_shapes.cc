// Lab 15: how close the fp32 products can come to the FMA peak on this CPU (issue 40). The
// library's register-blocked micro-kernel (src/kernel/simd_tile.h, `micro<R, C>`: R rows of A
// broadcast, C vectors of B, R x C accumulators) in several register shapes, and the library's
// `gemm_rows` in the forward's two call shapes, each against `measure_fma_peak` (register-only
// FMA chains), in one run, on buffers on cache lines (LineVector), one thread:
//   L1      a 64-deep product whose A, B and C stay in L1 (A R x 64, B 64 x C vectors), again and
//           again: the shape's own ceiling with nothing to wait for;
//   S       256 query rows (L2) x 64 keys x D = 128, the K^T tiles of a head streamed from L3 /
//           L2 (the forward's S = Q K^T with 4 query tiles a task), with the library's K panels
//           and without;
//   PV      O += P V for 256 rows, k = 64 (one V tile, the library) and 128 (two consecutive V
//           tiles: a 2-tile online-softmax step), acc [256][144] in L2.
// Each figure is the median over the repeats of one timing by CPU time; the shapes alternate
// within a repetition. The sums are checked against a plain fp64 loop on the first rows, so the
// loops are the real products. Arguments: [repeats] (default 5).
//   ./build/dev/lab_15_micro_shapes 5
// What it says (docs/kernel.md, "Round seven"): the AVX-512 shapes that fit the 32 registers
// reach 0.82-0.90 of the peak with everything in L1, and the forward's products 0.77-0.85 in
// their real shapes; the rest of the forward (softmax, interleaving) leaves its loop at ~0.70.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "15_micro_shapes.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <string>
#include <vector>

#include "core/environment.h"
#include "kernel/lines.h"
#include "kernel/problem.h"
#include "kernel/simd_tile.h"
#include "lab_common.h"  // Figure, product_error, print_figures

HWY_BEFORE_NAMESPACE();
namespace lab::HWY_NAMESPACE {
using namespace ctxpar::kernel::HWY_NAMESPACE;
using ctxpar::kernel::kernel_k_panel;
using ctxpar::kernel::LineVector;

// C (m x n, row stride ldc) += A (m x k, lda) B (k x n, ldb) by micro<R, C> blocks; m a multiple
// of R, n of C vectors.
template <int R, int C>
HWY_NOINLINE void blocks(int64_t m, int64_t n, int64_t k, const float* a, int64_t lda,
                         const float* b, int64_t ldb, float* c, int64_t ldc) {
  const int64_t w = C * lanes();
  for (int64_t j = 0; j + w <= n; j += w)
    for (int64_t r = 0; r + R <= m; r += R)
      micro<R, C>(a + r * lda, lda, b + j, ldb, k, c + r * ldc + j, ldc, true);
}

std::vector<Figure> Run(int repeats) {
  const int64_t nl = lanes(), d = 128, ld = padded_ld(round_up(d, nl)), rows = 256;
  const int64_t nkt = 64;  // key tiles of a head streamed (T = 4096)
  auto fill = [](LineVector<float>& v, unsigned seed) {
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = static_cast<float>((seed * 2654435761u + i * 40503u) % 2001) / 1000.0f - 1.0f;
  };
  LineVector<float> a(rows * ld), b(nkt * d * kTile), v(nkt * kTile * ld), p(rows * 2 * kTile),
      c(rows * ld), small_a(16 * 64), small_b(64 * 8 * nl), small_c(16 * 8 * nl);
  fill(a, 1), fill(b, 2), fill(v, 3), fill(p, 4), fill(small_a, 5), fill(small_b, 6);
  std::vector<Figure> out;
  // The L1 shapes: reps calls of a 64-deep product on the same small A, B, C.
  constexpr int64_t kReps = 20000;
  struct L1Shape {
    const char* name;
    int64_t r, cv;
    void (*fn)(int64_t, int64_t, int64_t, const float*, int64_t, const float*, int64_t, float*,
               int64_t);
  };
  const bool wide = HWY_MAX_BYTES >= 64;  // 32 vector registers (AVX-512) or 16
  std::vector<L1Shape> shapes;
  if (wide) {
    shapes = {{"L1 6 x 4 (the library's)", 6, 4, &blocks<6, 4>},
              {"L1 8 x 3", 8, 3, &blocks<8, 3>},
              {"L1 12 x 2", 12, 2, &blocks<12, 2>},
              {"L1 14 x 2", 14, 2, &blocks<14, 2>},
              {"L1 4 x 6", 4, 6, &blocks<4, 6>}};
  } else {
    shapes = {{"L1 6 x 2 (the library's)", 6, 2, &blocks<6, 2>},
              {"L1 4 x 3", 4, 3, &blocks<4, 3>},
              {"L1 3 x 4", 3, 4, &blocks<3, 4>}};
  }
  for (const L1Shape& s : shapes) out.push_back({s.name, 2.0 * kReps * s.r * s.cv * nl * 64, {}});
  out.push_back({"S, no K panels", 2.0 * nkt * rows * kTile * d, {}});
  out.push_back({"S, K panels (the library's)", 2.0 * nkt * rows * kTile * d, {}});
  out.push_back({"PV, k = 64 (the library's)", 2.0 * nkt * rows * d * kTile, {}});
  out.push_back({"PV, k = 128 (2 tiles a step)", 2.0 * nkt * rows * d * kTile, {}});
  const int64_t k_panel = kernel_k_panel(kTile, d, 0);
  for (int rep = 0; rep < repeats; ++rep) {
    size_t f = 0;
    for (const L1Shape& s : shapes) {
      // One call checked from C = 0, then the timed calls on the same buffers.
      std::fill(small_c.begin(), small_c.end(), 0.0f);
      s.fn(s.r, s.cv * nl, 64, small_a.data(), 64, small_b.data(), 8 * nl, small_c.data(), 8 * nl);
      out[f].max_err =
          std::max(out[f].max_err, product_error(s.r, 64, small_a.data(), 64, small_b.data(),
                                                 8 * nl, small_c.data(), 8 * nl));
      const double t0 = cpu_seconds();
      for (int64_t i = 0; i < kReps; ++i)
        s.fn(s.r, s.cv * nl, 64, small_a.data(), 64, small_b.data(), 8 * nl, small_c.data(),
             8 * nl);
      out[f].seconds.push_back(cpu_seconds() - t0);
      ++f;
    }
    // The streamed shapes: an untimed pass first, so each timed one finds the tiles where the
    // pass before it left them (in L2 / L3), whatever ran before (else the second of two
    // figures gained 5-15 % from the first one's loads).
    for (int panels = 0; panels <= 1; ++panels, ++f) {
      double t0 = 0;
      for (int pass = 0; pass < 2; ++pass) {
        t0 = cpu_seconds();
        for (int64_t kt = 0; kt < nkt; ++kt)
          gemm_rows(rows, kTile, d, a.data(), ld, b.data() + kt * d * kTile, kTile, p.data(), kTile,
                    false, panels ? k_panel : 0);
      }
      out[f].seconds.push_back(cpu_seconds() - t0);
      const int64_t last = (nkt - 1) * d * kTile;
      out[f].max_err = std::max(out[f].max_err, product_error(4, d, a.data(), ld, b.data() + last,
                                                              kTile, p.data(), kTile));
    }
    for (int64_t step = 1; step <= 2; ++step, ++f) {
      const int64_t k = step * kTile;
      std::fill(c.begin(), c.end(), 0.0f);  // one call checked from 0, then the timed ones
      gemm_rows(rows, d, k, p.data(), k, v.data(), ld, c.data(), ld, true);
      out[f].max_err =
          std::max(out[f].max_err, product_error(4, k, p.data(), k, v.data(), ld, c.data(), ld));
      double t0 = 0;
      for (int pass = 0; pass < 2; ++pass) {
        t0 = cpu_seconds();
        for (int64_t kt = 0; kt < nkt; kt += step)
          gemm_rows(rows, d, k, p.data(), k, v.data() + kt * kTile * ld, ld, c.data(), ld, true);
      }
      out[f].seconds.push_back(cpu_seconds() - t0);
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
  if (!lab::repeats_arg(argc, argv, "lab_15_micro_shapes", 5, repeats)) return 2;
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_SIMD
  ctxpar::kernel::select_simd_target();
  const double peak = ctxpar::kernel::measure_fma_peak(1).cpu_gflops;
  const std::vector<lab::Figure> figs = HWY_DYNAMIC_DISPATCH(lab::Run)(repeats);
  std::printf("lab_15_micro_shapes: SIMD %s, one thread, median of %d by CPU time\n",
              ctxpar::kernel::simd_target_name(), repeats);
  std::printf("  FMA peak (register-only chains)   %7.1f GFLOP/s\n", peak);
  // A sum of k <= 128 fp32 products: within k / 2 units of 2^-23 sum |a b| (the naive sum's
  // bound), which a wrong loop (a product missing or doubled) exceeds by orders of magnitude.
  const bool ok = lab::print_figures(figs, peak, [](const lab::Figure&) { return 64.0; });
  return ok ? 0 : 1;
}
#endif  // HWY_ONCE
