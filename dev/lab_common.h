// Shared by the kernel lab programs: inputs, timing (CPU time, robust on a shared machine) and
// the check against the library's fp64 reference. Each lab_NN program is one version of the
// non-causal attention forward, fp32, [T, H, D] with B = 1 and Hq = Hkv.
#pragma once
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <functional>
#include <string>
#include <vector>

#include "ctxpar/reference.h"
#include "ctxpar/tensor.h"
#include "kernel/amx_probe.h"

namespace lab {

// The [T] [H] [D] [repeats] arguments of a lab that times the library's forward (defaults
// 4096, 8, 128, `repeats`); false (usage printed) where one is out of range.
struct ForwardShapeArgs {
  int64_t t = 4096, h = 8, d = 128;
  int repeats = 3;
};
inline bool forward_shape_args(int argc, char** argv, const char* name, int64_t min_t,
                               ForwardShapeArgs& a) {
  if (argc > 1) a.t = std::atoll(argv[1]);
  if (argc > 2) a.h = std::atoll(argv[2]);
  if (argc > 3) a.d = std::atoll(argv[3]);
  if (argc > 4) a.repeats = std::atoi(argv[4]);
  if (a.t >= min_t && a.h >= 1 && a.d >= 16 && a.d <= 256 && a.repeats >= 1) return true;
  std::fprintf(stderr, "usage: %s [T >= %lld] [H >= 1] [D 16..256] [repeats >= 1]\n", name,
               static_cast<long long>(min_t));
  return false;
}

// The one [repeats] argument of a lab (`fallback` where absent); false (usage printed, naming
// the lab) where it is below 1.
inline bool repeats_arg(int argc, char** argv, const char* name, int fallback, int& repeats) {
  repeats = argc > 1 ? std::atoi(argv[1]) : fallback;
  if (repeats >= 1) return true;
  std::fprintf(stderr, "usage: %s [repeats >= 1]\n", name);
  return false;
}

// Whether AMX-BF16 tiles can run here; where not, says why (the AMX labs then exit 0).
inline bool amx_usable_or_say_why() {
  const std::string why = ctxpar::kernel::amx_unusable_why();
  if (!why.empty()) std::printf("AMX-BF16 not usable here: %s\n", why.c_str());
  return why.empty();
}

struct Problem {
  int64_t t = 1024, h = 2, d = 128;
  ctxpar::Tensor q, k, v;  // [1, T, H, D] fp32
  std::vector<int64_t> pos;
  Problem(int argc, char** argv) {
    if (argc > 1) t = std::atoll(argv[1]);
    if (argc > 2) h = std::atoll(argv[2]);
    if (argc > 3) d = std::atoll(argv[3]);
    q = ctxpar::Tensor(ctxpar::DType::f32, {1, t, h, d});
    k = ctxpar::Tensor(ctxpar::DType::f32, {1, t, h, d});
    v = ctxpar::Tensor(ctxpar::DType::f32, {1, t, h, d});
    ctxpar::fill_normal(q, 1), ctxpar::fill_normal(k, 2), ctxpar::fill_normal(v, 3);
    for (int64_t i = 0; i < t; ++i) pos.push_back(i);
  }
  double flops() const { return 4.0 * h * t * t * d; }
};

inline double cpu_seconds() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// The best of `repeats` calls of `f` by CPU time, in seconds.
template <class F>
double best_cpu_seconds(int repeats, F&& f) {
  double best = 1e300;
  for (int r = 0; r < repeats; ++r) {
    const double c0 = cpu_seconds();
    f();
    best = std::min(best, cpu_seconds() - c0);
  }
  return best;
}

// Times `run` (best of 3 by CPU time), checks `o` ([T, H, D]) against the fp64 reference on
// the first 64 query rows, prints one line, returns 0 when the error is below 1e-4.
inline int report(const char* name, const Problem& p, const std::function<void()>& run,
                  const std::vector<float>& o) {
  const double best = best_cpu_seconds(3, run);
  const int64_t rows = std::min<int64_t>(64, p.t);
  ctxpar::TensorView q_rows = p.q.view().slice(1, 0, rows);
  std::vector<int64_t> qpos(p.pos.begin(), p.pos.begin() + rows);
  const auto ref =
      ctxpar::reference::attention_f64(q_rows, {qpos, {}}, p.k, p.v, {p.pos, {}}, ctxpar::Mask{});
  double err = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) err = std::max(err, std::fabs(ref.o[i] - o[i]));
  std::printf(
      "%-12s T=%lld H=%lld D=%lld  %8.2f GFLOP/s (CPU time, best of 3)  max|o - ref64| = %.2e\n",
      name, (long long)p.t, (long long)p.h, (long long)p.d, p.flops() / best / 1e9, err);
  return err < 1e-4 ? 0 : 1;
}

// A timed figure of a lab that measures products (labs 15, 16): its FLOPs a timing, one timing a
// repetition (by CPU time), its worst error against fp64 on the checked entries.
struct Figure {
  std::string name;
  double flops = 0;
  std::vector<double> seconds;
  double max_err = 0;
};

// Largest |C - fp64| / (2^-23 sum |a b|) over rows x 16 entries of C = A B: A's element (r, x) at
// a[r lda + x], B's (x, j) at b[x ldb + j]. The naive fp32 sum's bound is k / 2 of these units.
inline double product_error(int64_t rows, int64_t k, const float* a, int64_t lda, const float* b,
                            int64_t ldb, const float* c, int64_t ldc) {
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < 16; ++j) {
      double s = 0, mag = 0;
      for (int64_t x = 0; x < k; ++x) {
        s += static_cast<double>(a[r * lda + x]) * b[x * ldb + j];
        mag += std::fabs(static_cast<double>(a[r * lda + x]) * b[x * ldb + j]);
      }
      worst = std::max(worst, std::fabs(c[r * ldc + j] - s) / (mag * 0x1p-23));
    }
  return worst;
}

// Each figure's median GFLOP/s, its share of `peak` and its error, a line each; false where an
// error is over bound(figure).
template <class Bound>
bool print_figures(std::vector<Figure> figs, double peak, Bound&& bound) {
  bool ok = true;
  for (Figure& f : figs) {
    std::sort(f.seconds.begin(), f.seconds.end());
    const double s = f.seconds[f.seconds.size() / 2], g = f.flops / s / 1e9;
    std::printf("  %-32s %7.1f GFLOP/s  %5.1f %% of peak   (error %.3f x 2^-23 sum |a b|)\n",
                f.name.c_str(), g, 100 * g / peak, f.max_err);
    ok = ok && f.max_err <= bound(f);
  }
  if (!ok) std::printf("a product is wrong (error over its bound)\n");
  return ok;
}

}  // namespace lab
