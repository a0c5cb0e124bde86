// Lab 04: where the fast forward's time goes. The library's own micro-kernel, exp2, K panels
// and padded rows (src/kernel/simd_tile.h, compiled per SIMD target like the library and
// dispatched to the same target, CTXPAR_SIMD respected), on packed tiles of one head,
// non-causal, one thread, timed phase by phase in one run against the FMA peak:
//   S    = Q K^T products alone        (2 * T * T * D FLOPs)
//   PV   = O += P V products alone     (2 * T * T * D FLOPs)
//   soft = the online softmax alone    (row max, rescale, exp2, row sums), as a share of `full`
//   full = the three in the library's order, query tile by query tile
// Each phase is the best of --repeats passes over T x T; phases alternate within a repetition.
// `full` is also checked against the fp64 reference on 64 query rows, so the loop is the real
// computation. Arguments: [T] [D] [query rows a task: 64 | 128 (the library) | 192] [repeats].
//   ./build/dev/lab_04_phases 4096 128 128 5
// What it says (docs/kernel.md, "Where the forward's time goes"): the products reach their
// isolated speed only when nothing else runs; softmax and the interleaving cost the rest.
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "04_phases.cc"
#include <hwy/foreach_target.h>  // IWYU pragma: keep

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "core/environment.h"
#include "kernel/lines.h"
#include "kernel/problem.h"
#include "kernel/simd_tile.h"

#ifndef LAB_04_PHASES_ONCE  // defined once, not per target
#define LAB_04_PHASES_ONCE
namespace lab {
struct Phases {
  double s = 0, pv = 0, soft = 0, full = 0, full2 = 0;  // seconds, best of the repetitions
};
}  // namespace lab
#endif

HWY_BEFORE_NAMESPACE();
namespace lab::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;
using namespace ctxpar::kernel::HWY_NAMESPACE;
using ctxpar::kernel::kernel_k_panel;
using ctxpar::kernel::kNegInf;

// The online softmax of `rows` rows, with the library's own row function (simd_tile.h).
HWY_INLINE void softmax_rows(float* s, int64_t rows, float* m, float* lv, float* acc, int64_t ld,
                             int64_t dp) {
  const int64_t nl = lanes();
  for (int64_t r = 0; r < rows; ++r)
    softmax_row<false>(s + r * kTile, m[r], lv + r * nl, acc + r * ld, dp, nullptr);
}

Phases Run(const float* q, const float* k, const float* v, int64_t t, int64_t d, int64_t qrows,
           int repeats, float* out, float* out2) {
  const int64_t nl = lanes(), dp = round_up(d, nl), ld = padded_ld(dp), nt = t / kTile;
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  // Packed as the library packs: K^T tiles [D][64], V tiles [64][ld], Q rows [T][ld] scaled.
  ctxpar::kernel::LineVector<float> kp(nt * d * kTile), vp(nt * kTile * ld, 0.0f), qp(t * ld, 0.0f);
  for (int64_t j = 0; j < t; ++j)
    for (int64_t c = 0; c < d; ++c) {
      kp[(j / kTile) * d * kTile + c * kTile + j % kTile] = k[j * d + c];
      vp[j * ld + c] = v[j * d + c];
    }
  for (int64_t i = 0; i < t; ++i)
    for (int64_t c = 0; c < d; ++c) qp[i * ld + c] = q[i * d + c] * scale;
  const int64_t k_panel = kernel_k_panel(kTile, d, 0);
  ctxpar::kernel::LineVector<float> s(2 * qrows * kTile), acc(qrows * ld), m(qrows), lv(qrows * nl);
  ctxpar::kernel::LineVector<float> s_saved(qrows * kTile);
  auto seconds = [](auto&& f) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  };
  auto reset_state = [&] {
    std::fill(acc.begin(), acc.end(), 0.0f);
    std::fill(m.begin(), m.end(), kNegInf);
    std::fill(lv.begin(), lv.end(), 0.0f);
  };
  auto s_product = [&](int64_t i0, int64_t kt) {
    gemm_rows(qrows, kTile, d, qp.data() + i0 * ld, ld, kp.data() + kt * d * kTile, kTile, s.data(),
              kTile, false, k_panel);
  };
  auto pv_product = [&](int64_t kt) {
    gemm_rows(qrows, dp, kTile, s.data(), kTile, vp.data() + kt * kTile * ld, ld, acc.data(), ld,
              true);
  };
  // A realistic score tile for the softmax-only phase (the first tile's scores).
  s_product(0, 0);
  std::copy(s.begin(), s.begin() + s_saved.size(), s_saved.begin());
  Phases best{1e30, 1e30, 1e30, 1e30, 1e30};
  for (int rep = 0; rep < repeats; ++rep) {
    best.s = std::min(best.s, seconds([&] {
                        for (int64_t i0 = 0; i0 < t; i0 += qrows)
                          for (int64_t kt = 0; kt < nt; ++kt) s_product(i0, kt);
                      }));
    best.pv = std::min(best.pv, seconds([&] {
                         for (int64_t i0 = 0; i0 < t; i0 += qrows) {
                           reset_state();
                           for (int64_t kt = 0; kt < nt; ++kt) pv_product(kt);
                         }
                       }));
    best.soft =
        std::min(best.soft, seconds([&] {
                   for (int64_t i0 = 0; i0 < t; i0 += qrows) {
                     reset_state();
                     for (int64_t kt = 0; kt < nt; ++kt) {
                       std::copy(s_saved.begin(), s_saved.end(), s.begin());
                       softmax_rows(s.data(), qrows, m.data(), lv.data(), acc.data(), ld, dp);
                     }
                   }
                 }));
    best.full = std::min(
        best.full, seconds([&] {
          for (int64_t i0 = 0; i0 < t; i0 += qrows) {
            reset_state();
            for (int64_t kt = 0; kt < nt; ++kt) {
              s_product(i0, kt);
              softmax_rows(s.data(), qrows, m.data(), lv.data(), acc.data(), ld, dp);
              pv_product(kt);
            }
            for (int64_t r = 0; r < qrows; ++r) {
              const DF df;
              const float l = hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, lv.data() + r * nl)));
              for (int64_t c = 0; c < d; ++c) out[(i0 + r) * d + c] = acc[r * ld + c] / l;
            }
          }
        }));
    // Candidate: two key tiles an online-softmax step (S of both side by side, rows 2 kTile
    // floats apart; one max and one rescale a row for the step; O += P V with k = 2 kTile over
    // the two consecutive V tiles).
    best.full2 = std::min(
        best.full2, seconds([&] {
          const int64_t w = 2 * kTile;
          for (int64_t i0 = 0; i0 < t; i0 += qrows) {
            reset_state();
            for (int64_t kt = 0; kt < nt; kt += 2) {
              for (int64_t g = 0; g < 2; ++g)
                gemm_rows(qrows, kTile, d, qp.data() + i0 * ld, ld,
                          kp.data() + (kt + g) * d * kTile, kTile, s.data() + g * kTile, w, false,
                          k_panel);
              for (int64_t r = 0; r < qrows; ++r)
                softmax_row<false>(s.data() + r * w, m[r], lv.data() + r * nl, acc.data() + r * ld,
                                   dp, nullptr, 2, kTile);
              gemm_rows(qrows, dp, w, s.data(), w, vp.data() + kt * kTile * ld, ld, acc.data(), ld,
                        true);
            }
            for (int64_t r = 0; r < qrows; ++r) {
              const DF df;
              const float l = hn::GetLane(hn::SumOfLanes(df, hn::LoadU(df, lv.data() + r * nl)));
              for (int64_t c = 0; c < d; ++c) out2[(i0 + r) * d + c] = acc[r * ld + c] / l;
            }
          }
        }));
  }
  // The softmax-only phase also copied the saved tile back in every step: take that out.
  const double copy = seconds([&] {
    for (int64_t i0 = 0; i0 < t; i0 += qrows)
      for (int64_t kt = 0; kt < nt; ++kt) {
        std::copy(s_saved.begin(), s_saved.end(), s.begin());
        __asm__ volatile("" : : "r"(s.data()) : "memory");  // the copy is not dropped
      }
  });
  best.soft = std::max(0.0, best.soft - copy);
  return best;
}

}  // namespace lab::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
#include "ctxpar/reference.h"
#include "ctxpar/tensor.h"
#include "kernel/peak.h"

namespace lab {
HWY_EXPORT(Run);
}  // namespace lab

int main(int argc, char** argv) {
  const int64_t t = argc > 1 ? std::atoll(argv[1]) : 4096, d = argc > 2 ? std::atoll(argv[2]) : 128;
  const int64_t qrows = argc > 3 ? std::atoll(argv[3]) : 128;
  const int repeats = argc > 4 ? std::atoi(argv[4]) : 3;
  if ((qrows != 64 && qrows != 128 && qrows != 192 && qrows != 256) || t < qrows ||
      t % qrows != 0 || d < 16 || d > 256 || repeats < 1) {
    std::fprintf(stderr,
                 "usage: lab_04_phases [T, a multiple of 64 and of the query rows] [D 16..256] "
                 "[query rows 64|128|192|256] [repeats >= 1]\n");
    return 2;
  }
  ctxpar::set_kernel_environment(ctxpar::environment::kernel());  // CTXPAR_SIMD
  ctxpar::kernel::select_simd_target();
  ctxpar::Tensor q(ctxpar::DType::f32, {1, t, 1, d}), k(ctxpar::DType::f32, {1, t, 1, d}),
      v(ctxpar::DType::f32, {1, t, 1, d});
  ctxpar::fill_normal(q, 1), ctxpar::fill_normal(k, 2), ctxpar::fill_normal(v, 3);
  std::vector<float> out(t * d), out2(t * d);
  const ctxpar::kernel::Peak peak = ctxpar::kernel::measure_fma_peak(1);
  const lab::Phases ph =
      HWY_DYNAMIC_DISPATCH(lab::Run)(q.ptr<float>(), k.ptr<float>(), v.ptr<float>(), t, d, qrows,
                                     repeats, out.data(), out2.data());
  std::vector<int64_t> pos(t);
  for (int64_t i = 0; i < t; ++i) pos[i] = i;
  const int64_t rows = 64;
  std::vector<int64_t> qpos(pos.begin(), pos.begin() + rows);
  const auto ref = ctxpar::reference::attention_f64(q.view().slice(1, 0, rows), {qpos, {}}, k, v,
                                                    {pos, {}}, ctxpar::Mask{});
  double err = 0, err2 = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    err = std::max(err, std::fabs(ref.o[i] - out[i]));
    err2 = std::max(err2, std::fabs(ref.o[i] - out2[i]));
  }
  const double half = 2.0 * t * t * d, peak_g = peak.gflops;
  auto line = [&](const char* name, double s, double flops) {
    std::printf("  %-34s %8.4f s  %7.1f GFLOP/s  %5.1f %% of peak\n", name, s, flops / s / 1e9,
                100 * flops / s / 1e9 / peak_g);
  };
  std::printf(
      "lab_04_phases T=%lld D=%lld, %lld query rows a task, SIMD %s, best of %d, one thread\n",
      (long long)t, (long long)d, (long long)qrows, ctxpar::kernel::simd_target_name(), repeats);
  std::printf("  FMA peak %.1f GFLOP/s\n", peak_g);
  line("S = Q K^T alone", ph.s, half);
  line("O += P V alone", ph.pv, half);
  std::printf("  %-34s %8.4f s  (%4.1f %% of the full loop)\n", "softmax alone", ph.soft,
              100 * ph.soft / ph.full);
  line("full loop (S, softmax, PV)", ph.full, 2 * half);
  line("ceiling: sum of the phases alone", ph.s + ph.pv + ph.soft, 2 * half);
  std::printf("  interleaving cost (full - sum of phases): %.1f %% of the full loop\n",
              100 * (ph.full - ph.s - ph.pv - ph.soft) / ph.full);
  line("candidate: 2 key tiles a step", ph.full2, 2 * half);
  std::printf("  max |o - ref64| on 64 rows: %.2e (2 tiles a step: %.2e)\n", err, err2);
  return err < 1e-4 && err2 < 1e-4 ? 0 : 1;
}
#endif  // HWY_ONCE
