// Lab 13: the online softmax's exponential on AVX-512 (issue 40; src/kernel/simd_tile.h,
// exp2_neg). The softmax pass of the forward (P = 2^((S - m) log2 e), summed and stored) over
// 16 rows x 256 keys (16 KiB: in L1), 128 rows x 256 keys (128 KiB: the forward's key step, in
// L2) and the same with the scores of a causal diagonal tile masked (-inf above it: a quarter of
// the step's 4 tiles when one of them is the diagonal), with four forms of 2^t, t <= 0:
//   taylor7:  t clamped at -150, n = round(t) (vrndscaleps), f = t - n in [-1/2, 1/2], the
//             degree-7 Taylor polynomial of 2^f, then 2^n by vscalefps (the library's form
//             before this lab);
//   minimax6: f = t - floor(t) in [0, 1) in one vreduceps, the minimax polynomial 1 + f q(f) of
//             degree 6 (p(0) = 1 exactly, so P = 1 at the max), then vscalefps by t itself (it
//             scales by 2^floor(t)); no clamp: vreduceps of -inf is 0, 2^-inf scales to 0;
//   masked6:  minimax6 with the lanes t < -126 zeroed by vscalefps's mask (the library's form);
//   masked5:  the same with a minimax polynomial of degree 5.
// A result below 2^-126 (a denormal, or an underflow to 0) takes a microcode assist; the
// masked forms never make one. Each form's largest relative error against exp2 in double over
// t in [-125, 0], its value at -inf, 0 and below 2^-126, and its time by CPU time (alternating,
// median of the repeats), as ns a 16-float vector. Exits 0 with a note where AVX-512 DQ is
// absent; 1 if a form is wrong.
//   ./build/dev/lab_13_exp2 [repeats]
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "lab_common.h"

namespace {

#define LAB_AVX512 __attribute__((target("avx512f,avx512dq")))

enum Form { taylor7, minimax6, masked6, masked5, kForms };
const char* const kNames[] = {"taylor7", "minimax6", "masked6", "masked5"};

LAB_AVX512 inline __m512 horner(__m512 f, const float* c, int n) {
  __m512 p = _mm512_set1_ps(c[n - 1]);
  for (int i = n - 2; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  return p;
}

template <Form kForm>
LAB_AVX512 inline __m512 exp2_form(__m512 t) {
  // 2^f = 1 + f q(f); q's coefficients from low to high.
  static const float kTaylor[] = {1.0f,
                                  6.9314718055994531e-1f,
                                  2.4022650695910071e-1f,
                                  5.5504108664821580e-2f,
                                  9.6181291076284772e-3f,
                                  1.3333558146428443e-3f,
                                  1.5403530393381606e-4f,
                                  1.5252733804059841e-5f};
  static const float kMinimax6[] = {1.0f,
                                    0.6931470632553101f,
                                    0.2402293086051941f,
                                    0.055485282093286514f,
                                    0.009675451554358006f,
                                    0.0012467842316254973f,
                                    0.00021612927957903594f};
  static const float kMinimax5[] = {1.0f,
                                    0.6931512951850891f,
                                    0.24016444385051727f,
                                    0.05579991638660431f,
                                    0.009017026983201504f,
                                    0.0018671316793188453f};
  if constexpr (kForm == taylor7) {
    t = _mm512_max_ps(t, _mm512_set1_ps(-150.0f));
    const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    return _mm512_scalef_ps(horner(_mm512_sub_ps(t, n), kTaylor, 8), n);
  } else {
    const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
    const __m512 p = kForm == masked5 ? horner(f, kMinimax5, 6) : horner(f, kMinimax6, 7);
    if constexpr (kForm == minimax6) return _mm512_scalef_ps(p, t);
    const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
    return _mm512_maskz_scalef_ps(normal, p, t);
  }
}

// The softmax pass of one key step: rows x 256 scores at s (row stride 256), the row's max m,
// P stored at p (the library stores it over S; here S stays for the next pass) and summed into
// sums[r].
template <Form kForm>
LAB_AVX512 void softmax_pass(const float* s, float* p, int rows, const float* m, float* sums) {
  const __m512 vlog2e = _mm512_set1_ps(1.4426950408889634f);
  for (int r = 0; r < rows; ++r) {
    const float* sr = s + r * 256;
    float* pr = p + r * 256;
    const __m512 vm = _mm512_set1_ps(m[r]);
    __m512 vsum = _mm512_setzero_ps();
    for (int c = 0; c < 256; c += 16) {
      const __m512 x = _mm512_loadu_ps(sr + c);
      const __m512 e = exp2_form<kForm>(_mm512_mul_ps(_mm512_sub_ps(x, vm), vlog2e));
      vsum = _mm512_add_ps(vsum, e);
      _mm512_storeu_ps(pr + c, e);
    }
    sums[r] += _mm512_reduce_add_ps(vsum);
  }
}

template <Form kForm>
LAB_AVX512 void exp2_array(const float* in, float* out, size_t n) {
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 k = n - i >= 16 ? 0xffff : static_cast<__mmask16>((1u << (n - i)) - 1);
    _mm512_mask_storeu_ps(out + i, k, exp2_form<kForm>(_mm512_maskz_loadu_ps(k, in + i)));
  }
}

// Largest relative error over [-125, 0], the values at -inf, 0, and below 2^-126; false if
// any is wrong (the library's test's bounds: 3e-7, exactly 0 and 1, at most 2^-125).
template <Form kForm>
bool accurate(double& worst) {
  std::vector<float> in;
  for (double t = -125; t <= 0; t += 1.0 / 4096) in.push_back(static_cast<float>(t));
  for (float t = -1e-7f; t > -1e-44f; t *= 0.5f) in.push_back(t);  // just below 0: f near 1
  const size_t special = in.size();
  in.insert(in.end(), {-INFINITY, 0.0f, -126.5f, -149.0f, -151.0f, -1e30f});
  std::vector<float> out(in.size());
  exp2_array<kForm>(in.data(), out.data(), in.size());
  worst = 0;
  for (size_t i = 0; i < special; ++i) {
    const double exact = std::exp2(static_cast<double>(in[i]));
    worst = std::max(worst, std::fabs(out[i] - exact) / exact);
  }
  bool ok = worst < 3e-7 && out[special] == 0.0f && out[special + 1] == 1.0f;
  for (size_t i = special + 2; i < in.size(); ++i) ok &= out[i] >= 0.0f && out[i] <= 0x1p-125f;
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 0;
  if (!lab::repeats_arg(argc, argv, "lab_13_exp2", 7, repeats)) return 2;
  if (!__builtin_cpu_supports("avx512dq")) {
    std::printf("AVX-512 DQ absent here: vreduceps and vscalefps need it; nothing to time\n");
    return 0;
  }
  int failed = 0;
  double err[kForms];
  failed |= !accurate<taylor7>(err[0]);
  failed |= !accurate<minimax6>(err[1]);
  failed |= !accurate<masked6>(err[2]);
  failed |= !accurate<masked5>(err[3]);
  std::printf("largest relative error over [-125, 0] (fp32 ulp at 1: 1.2e-7):");
  for (int f = 0; f < kForms; ++f) std::printf(" %s %.2e", kNames[f], err[f]);
  std::printf("\n");

  // Scores like a step's: normal(0, 3), the row max its true max.
  std::mt19937 gen(7);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  for (const int kind : {0, 1, 2}) {
    const int rows = kind == 0 ? 16 : 128;
    std::vector<float> src(static_cast<size_t>(rows) * 256), s(src.size()), m(rows), sums(rows);
    for (float& x : src) x = dist(gen);
    if (kind == 2)  // a causal diagonal tile among the step's 4: keys c > r masked in it
      for (int r = 0; r < rows; ++r)
        for (int c = 0; c < 64; ++c)
          if (c > r % 64) src[r * 256 + 192 + c] = -INFINITY;
    for (int r = 0; r < rows; ++r)
      m[r] = *std::max_element(src.begin() + r * 256, src.begin() + (r + 1) * 256);
    const int passes = 400000 / rows;  // the same number of vectors for both sizes
    std::vector<double> ns[kForms];
    for (int rep = -1; rep < repeats; ++rep)
      for (int f = 0; f < kForms; ++f) {
        const double c0 = lab::cpu_seconds();
        for (int pass = 0; pass < passes; ++pass) {
          if (f == taylor7)
            softmax_pass<taylor7>(src.data(), s.data(), rows, m.data(), sums.data());
          if (f == minimax6)
            softmax_pass<minimax6>(src.data(), s.data(), rows, m.data(), sums.data());
          if (f == masked6)
            softmax_pass<masked6>(src.data(), s.data(), rows, m.data(), sums.data());
          if (f == masked5)
            softmax_pass<masked5>(src.data(), s.data(), rows, m.data(), sums.data());
        }
        const double total = lab::cpu_seconds() - c0;
        if (rep >= 0) ns[f].push_back(total / (static_cast<double>(passes) * rows * 16) * 1e9);
      }
    const char* const kKinds[] = {"L1", "L2", "L2, a diagonal tile"};
    std::printf("%3d rows x 256 keys (%s), ns a vector, median of %d:", rows, kKinds[kind],
                repeats);
    for (int f = 0; f < kForms; ++f) {
      std::sort(ns[f].begin(), ns[f].end());
      std::printf(" %s %.3f", kNames[f], ns[f][ns[f].size() / 2]);
    }
    std::printf("\n");
  }
  if (failed) std::printf("FAILED: a form is outside its bounds\n");
  return failed;
}
