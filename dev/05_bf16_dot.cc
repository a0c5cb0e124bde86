// Lab 05: would bf16 products make the kernel faster than fp32 FMAs on this CPU? The
// instruction throughput of AVX512_BF16's vdpbf16ps (16 lanes x a pair of bf16 products = 64
// FLOPs) against vfmadd231ps (16 lanes = 32 FLOPs), each on 24 independent register chains
// (more than latency x ports on any current core, so the figure is throughput), one thread.
// Measured on the Intel build machine (docs/BENCHMARKS.md): vdpbf16ps gives half the FLOP/s of
// fp32 FMAs there, so a bf16-product kernel path would be slower, not faster; only AMX tiles
// (not exposed on that KVM guest) would beat the fp32 FMA peak.
//   ./build/dev/lab_05_bf16_dot
// Exits 0 with a note on CPUs without AVX512_BF16 (Zen 3 has no bf16 instruction at all).
#include <immintrin.h>

#include <chrono>
#include <cstdio>

namespace {

constexpr long kIterations = 50'000'000;  // x 24 instructions

// clang-format off
#define CTXPAR_LAB_CHAINS(OP) \
  OP(a0) OP(a1) OP(a2) OP(a3) OP(a4) OP(a5) OP(a6) OP(a7) OP(a8) OP(a9) OP(a10) OP(a11) \
  OP(b0) OP(b1) OP(b2) OP(b3) OP(b4) OP(b5) OP(b6) OP(b7) OP(b8) OP(b9) OP(b10) OP(b11)
// clang-format on
// Named variables (GCC keeps arrays of vectors on the stack); the empty asm keeps every chain
// live and in a register.
#define CTXPAR_LAB_DECLARE(v) __m512 v = _mm512_set1_ps(seed);
#define CTXPAR_LAB_KEEP(v) __asm__ volatile("" : "+v"(v));
#define CTXPAR_LAB_SUM(v) sum = _mm512_add_ps(sum, v);

// (Not _mm512_reduce_add_ps: GCC 12's header warns about its own uninitialised temporary.)
__attribute__((target("avx512f"))) inline float lanes_sum(__m512 v) {
  alignas(64) float x[16];
  _mm512_store_ps(x, v);
  float s = 0;
  for (float f : x) s += f;
  return s;
}

// 24 chains of vdpbf16ps (kBf16) or of vfmadd231ps; returns a checksum, sets the seconds.
template <bool kBf16>
__attribute__((target("avx512f,avx512bf16,fma"), noinline)) float chains(float seed,
                                                                         double* seconds) {
  CTXPAR_LAB_CHAINS(CTXPAR_LAB_DECLARE)
  const __m512bh x = (__m512bh)_mm512_set1_epi32(0x3f803f80);  // bf16 pairs (1, 1)
  const __m512bh y = (__m512bh)_mm512_set1_epi32(0x33d633d6);  // (1e-7, 1e-7)
  const __m512 m = _mm512_set1_ps(0.999999f), c = _mm512_set1_ps(1e-7f);
  const auto t0 = std::chrono::steady_clock::now();
  for (long i = 0; i < kIterations; ++i) {
#define CTXPAR_LAB_STEP(v) v = kBf16 ? _mm512_dpbf16_ps(v, x, y) : _mm512_fmadd_ps(v, m, c);
    CTXPAR_LAB_CHAINS(CTXPAR_LAB_STEP)
    CTXPAR_LAB_CHAINS(CTXPAR_LAB_KEEP)
  }
  *seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  __m512 sum = _mm512_setzero_ps();
  CTXPAR_LAB_CHAINS(CTXPAR_LAB_SUM)
  return lanes_sum(sum);
}

}  // namespace

int main() {
  __builtin_cpu_init();
  if (!__builtin_cpu_supports("avx512bf16")) {
    std::printf("lab_05_bf16_dot: this CPU has no AVX512_BF16 (vdpbf16ps); nothing to measure\n");
    return 0;
  }
  double best_dp = 1e30, best_fma = 1e30, s = 0;
  float sink = 0;
  for (int rep = 0; rep < 3; ++rep) {  // alternating, best of 3
    sink += chains<true>(1.0f + rep, &s), best_dp = s < best_dp ? s : best_dp;
    sink += chains<false>(1.0f + rep, &s), best_fma = s < best_fma ? s : best_fma;
  }
  const double n = 24.0 * kIterations;
  const double dp = n * 64 / best_dp / 1e9, fma = n * 32 / best_fma / 1e9;
  std::printf(
      "vdpbf16ps %.1f GFLOP/s, vfmadd231ps %.1f GFLOP/s: bf16 products give %.2fx the fp32 "
      "FMA rate (one thread, best of 3; checksum %g)\n",
      dp, fma, dp / fma, sink);
  return 0;
}
