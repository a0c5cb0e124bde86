// Lab 17: what one thread pays where the bf16 forward switches between AMX tile products and
// the softmax's AVX-512 work (issue 40, docs/kernel.md "Round twelve"). The unit of tile work is
// the forward's S for one key tile (128 query rows x 64 keys, D = 128: 8 blocks of 2 x 2 C tiles,
// 4 tdpbf16ps steps each, as `bf16::scores_amx` makes them); the unit of vector work is the
// softmax's exponential pass over 16 rows x 256 scores (the library's exp2 form, simd_tile.h).
//   1. The tile work in L1 four ways: as the library orders it; with each tile load right before
//      its first use; with the tile configuration loaded and released around it (what every
//      `scores_amx` call does); without the C stores (the stores' share).
//   2. The first tile unit after a gap: K vector units, or a scalar loop of N iterations, then
//      two tile units timed one by one (TSC cycles): the first pays for the gap.
//   3. The two interleaved at a granularity g (g tile units, then 4 g vector units, repeated)
//      against each alone: the cost of a switch, amortised over g.
//   4. The tile unit kept busy through the vector work (one tdpbf16ps after each vector unit):
//      the first tile unit after, and what the vector units pay for it; the core's clock after
//      tile work (TSC cycles a dependent add, right after and after a gap), and one vector unit
//      right after tile work against right after vector work.
// Results are checked (every C element is the sum it must be); exits 1 if not, 0 with a note
// where AMX-BF16 is not usable.
//   ./build/dev/lab_17_amx_switch [repeats]
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "kernel/amx_probe.h"
#include "lab_common.h"

namespace {

#define LAB_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512dq"), noinline))

constexpr int kRows = 128, kPairs = 64, kKeys = 64;  // S of a key tile: 128 x 64, D = 128
alignas(64) uint32_t q_pairs[kRows * kPairs];        // Q rows, kPairs words apart
alignas(64) uint32_t k_pairs[kPairs * kKeys];        // K as [pairs][64 keys]
alignas(64) float s_out[kRows * kKeys];
alignas(64) float scores[16 * 256], probs[16 * 256];
volatile float sink;

LAB_AMX void configure() { ctxpar::kernel::load_tile_config(ctxpar::kernel::kTiles16x64); }

// kOrder 0: the library's (4 loads, then 4 tdpbf16ps); 1: each load right before its first use.
template <int kOrder, bool kStore>
LAB_AMX void tile_unit() {
  for (int r = 0; r < kRows; r += 32)
    for (int n = 0; n < kKeys; n += 32) {
      const uint32_t* a0 = q_pairs + r * kPairs;
      const uint32_t* a1 = a0 + 16 * kPairs;
      const uint32_t* b = k_pairs + n;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int p = 0; p < kPairs; p += 16) {
        if (kOrder == 0) {
          CTXPAR_TILE_LOAD(4, a0 + p, kPairs * 4);
          CTXPAR_TILE_LOAD(5, a1 + p, kPairs * 4);
          CTXPAR_TILE_LOAD(6, b + p * kKeys, kKeys * 4);
          CTXPAR_TILE_LOAD(7, b + p * kKeys + 16, kKeys * 4);
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        } else {
          CTXPAR_TILE_LOAD(4, a0 + p, kPairs * 4);
          CTXPAR_TILE_LOAD(6, b + p * kKeys, kKeys * 4);
          _tile_dpbf16ps(0, 4, 6);
          CTXPAR_TILE_LOAD(7, b + p * kKeys + 16, kKeys * 4);
          _tile_dpbf16ps(1, 4, 7);
          CTXPAR_TILE_LOAD(5, a1 + p, kPairs * 4);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
      }
      if (kStore) {
        float* c = s_out + r * kKeys + n;
        CTXPAR_TILE_STORE(0, c, kKeys * 4);
        CTXPAR_TILE_STORE(1, c + 16, kKeys * 4);
        CTXPAR_TILE_STORE(2, c + 16 * kKeys, kKeys * 4);
        CTXPAR_TILE_STORE(3, c + 16 * kKeys + 16, kKeys * 4);
      }
    }
}

LAB_AMX void tile_unit_configured() {
  configure();
  tile_unit<0, true>();
  _tile_release();
}

// 16 rows x 256 scores: P = 2^((s - m) log2 e) by the library's form (vreduceps, the degree-6
// minimax polynomial, vscalefps masked below -126), summed and stored.
LAB_AMX float vector_unit() {
  static const float c[] = {2.1612927957903594e-4f, 1.2467842316254973e-3f, 9.675451554358006e-3f,
                            5.5485282093286514e-2f, 2.402293086051941e-1f,  6.931470632553101e-1f};
  __m512 total = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(0.5f), l2e = _mm512_set1_ps(1.4426950408889634f);
  for (int r = 0; r < 16; ++r) {
    float* s = scores + r * 256;
    __m512 sum = _mm512_setzero_ps();
    for (int k = 0; k < 256; k += 16) {
      const __m512 t = _mm512_mul_ps(_mm512_sub_ps(_mm512_loadu_ps(s + k), vm), l2e);
      const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
      __m512 p = _mm512_set1_ps(c[0]);
      for (int i = 1; i < 6; ++i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
      p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
      const __m512 e = _mm512_maskz_scalef_ps(normal, p, t);
      sum = _mm512_add_ps(sum, e);
      _mm512_storeu_ps(probs + r * 256 + k, e);
    }
    total = _mm512_add_ps(total, sum);
  }
  return _mm512_reduce_add_ps(total);
}

LAB_AMX void release() { _tile_release(); }

// One tdpbf16ps on tiles already loaded (C 3 += A 4 B 6): tile work too small to cost, to keep
// the tile unit from idling while vector work runs (part 4).
LAB_AMX void keep_busy() { _tile_dpbf16ps(3, 4, 6); }

// TSC cycles of n dependent adds (one core cycle each): the core's clock against the TSC's.
__attribute__((noinline)) double clock_probe(long n) {
  long x = 0;
  const uint64_t a = __rdtsc();
  for (long i = 0; i < n; ++i) asm volatile("add %1, %0" : "+r"(x) : "r"(i));
  const uint64_t b = __rdtsc();
  sink = static_cast<float>(x);
  return static_cast<double>(b - a) / static_cast<double>(n);
}

__attribute__((noinline)) void scalar_spin(long n) {
  for (long i = 0; i < n; ++i) asm volatile("");
}

}  // namespace

int main(int argc, char** argv) {
  int repeats = 0;
  if (!lab::repeats_arg(argc, argv, "lab_17_amx_switch", 5, repeats)) return 2;
  if (!lab::amx_usable_or_say_why()) return 0;
  for (uint32_t& w : q_pairs) w = 0x3f803f80u;  // a pair of bf16 ones
  for (uint32_t& w : k_pairs) w = 0x3f803f80u;
  for (int i = 0; i < 16 * 256; ++i) scores[i] = -static_cast<float>(i % 7) * 0.1f;
  configure();
  tile_unit<0, true>();
  for (float x : s_out)
    if (x != 2.0f * kPairs) {  // each C element: 64 pairs of 1 x 1 + 1 x 1
      std::printf("wrong tile product: %g, expected %d\n", x, 2 * kPairs);
      return 1;
    }
  const double flops = 2.0 * kRows * kKeys * 2 * kPairs;
  const long n = 4000;
  // The four forms alternating within each repetition (the first loop of a run is slower while
  // the core's clock settles), best of the repetitions each.
  double best[4] = {1e300, 1e300, 1e300, 1e300};
  auto time = [&](int i, auto&& unit) {
    const double t0 = lab::cpu_seconds();
    for (long j = 0; j < n; ++j) unit();
    best[i] = std::min(best[i], lab::cpu_seconds() - t0);
  };
  for (int r = 0; r < repeats; ++r) {
    time(0, tile_unit<0, true>);
    time(1, tile_unit<1, true>);
    time(2, tile_unit_configured);
    configure();
    time(3, tile_unit<0, false>);
  }
  const auto rate = [&](int i) { return flops * static_cast<double>(n) / best[i] / 1e9; };
  std::printf("1. S of a key tile (128 x 64, D = 128) in L1, GFLOP/s by CPU time, best of %d:\n",
              repeats);
  std::printf(
      "   library order %.0f; loads before first use %.0f; configuration loaded and "
      "released each call %.0f; no C stores %.0f\n",
      rate(0), rate(1), rate(2), rate(3));

  std::printf("2. TSC cycles of the first and the second tile unit after a gap (mean of 2000):\n");
  auto after = [&](auto&& gap) {
    double first = 0, second = 0;
    for (int t = 0; t < 2000; ++t) {
      gap();
      const uint64_t a = __rdtsc();
      tile_unit<0, true>();
      const uint64_t b = __rdtsc();
      tile_unit<0, true>();
      const uint64_t c = __rdtsc();
      first += static_cast<double>(b - a), second += static_cast<double>(c - b);
    }
    std::printf(" %.0f / %.0f", first / 2000, second / 2000);
  };
  std::printf("   after K vector units, K = 0, 1, 4, 16, 64:");
  for (int k : {0, 1, 4, 16, 64})
    after([&] {
      for (int i = 0; i < k; ++i) sink = vector_unit();
    });
  std::printf("\n   after a scalar loop of N iterations, N = 100, 1000, 5000, 20000:");
  for (long spin : {100L, 1000L, 5000L, 20000L}) after([&] { scalar_spin(spin); });
  std::printf("\n");

  std::printf("3. g tile units then 4 g vector units, repeated, CPU time / (each alone):\n  ");
  const long units = 4096;
  const double t_tiles = lab::best_cpu_seconds(repeats, [&] {
    for (long i = 0; i < units; ++i) tile_unit<0, true>();
  });
  const double t_vec = lab::best_cpu_seconds(repeats, [&] {
    for (long i = 0; i < 4 * units; ++i) sink = vector_unit();
  });
  for (long g : {1L, 4L, 16L, 64L, 256L}) {
    const double t = lab::best_cpu_seconds(repeats, [&] {
      for (long i = 0; i < units; i += g) {
        for (long j = 0; j < g; ++j) tile_unit<0, true>();
        for (long j = 0; j < 4 * g; ++j) sink = vector_unit();
      }
    });
    std::printf(" g %ld: %.2f", g, t / (t_tiles + t_vec));
  }
  std::printf("  (tiles alone %.1f ms, vectors alone %.1f ms)\n", 1e3 * t_tiles, 1e3 * t_vec);

  // 4. The tile unit kept busy: one tdpbf16ps after each vector unit. Does the first tile unit
  // after K vector units still pay for waking up, and what do the vector units pay for it?
  std::printf(
      "4. one tdpbf16ps after each vector unit, K = 1, 4, 16, 64: the first / second tile "
      "unit after them (TSC cycles):");
  for (int k : {1, 4, 16, 64})
    after([&] {
      for (int i = 0; i < k; ++i) {
        sink = vector_unit();
        keep_busy();
      }
    });
  const double t_vec_busy = lab::best_cpu_seconds(repeats, [&] {
    for (long i = 0; i < 4 * units; ++i) {
      sink = vector_unit();
      keep_busy();
    }
  });
  std::printf("\n   vector units alone %.1f ms, each followed by one tdpbf16ps %.1f ms (%.2fx)\n",
              1e3 * t_vec, 1e3 * t_vec_busy, t_vec_busy / t_vec);
  // The core's clock right after each kind of work: TSC cycles a dependent add (mean of 500
  // probes of 2,000 adds, each after 16 units of the work).
  std::printf(
      "   TSC cycles a dependent add right after 16 units of: a scalar loop, vector work, "
      "vector work with one tdpbf16ps a unit, tile work:");
  const auto probe_after = [&](auto&& work) {
    double sum = 0, sum_long = 0;
    for (int t = 0; t < 500; ++t) {
      work();
      sum += clock_probe(2000);
      work();
      sum_long += clock_probe(50000);
    }
    std::printf(" %.3f (%.3f)", sum / 500, sum_long / 500);
  };
  probe_after([&] { scalar_spin(16 * 3000); });
  probe_after([&] {
    for (int i = 0; i < 16; ++i) sink = vector_unit();
  });
  probe_after([&] {
    for (int i = 0; i < 16; ++i) {
      sink = vector_unit();
      keep_busy();
    }
  });
  probe_after([&] {
    for (int i = 0; i < 16; ++i) tile_unit<0, true>();
  });
  // How long the clock stays where tile work left it: 16 tile units, a scalar loop of N
  // iterations, then the probe.
  const uint64_t s0 = __rdtsc();
  scalar_spin(1000000);
  const double spin_tsc = static_cast<double>(__rdtsc() - s0) / 1e6;
  std::printf(
      "\n   the same after 16 tile units and a scalar loop of N = 1e3, 1e4, 1e5, 1e6 "
      "(%.2f TSC cycles an iteration):",
      spin_tsc);
  for (long spin : {1000L, 10000L, 100000L, 1000000L})
    probe_after([&] {
      for (int i = 0; i < 16; ++i) tile_unit<0, true>();
      scalar_spin(spin);
    });
  // What the softmax's vector work pays for following tile work: one vector unit timed right
  // after 16 vector units and right after 16 tile units (TSC cycles, mean of 500).
  const auto vector_after = [&](auto&& work) {
    double sum = 0;
    for (int t = 0; t < 500; ++t) {
      work();
      const uint64_t a = __rdtsc();
      sink = vector_unit();
      sum += static_cast<double>(__rdtsc() - a);
    }
    return sum / 500;
  };
  const double v_after_v = vector_after([&] {
    for (int i = 0; i < 16; ++i) sink = vector_unit();
  });
  const double v_after_t = vector_after([&] {
    for (int i = 0; i < 16; ++i) tile_unit<0, true>();
  });
  std::printf(
      "\n   one vector unit right after 16 vector units %.0f, after 16 tile units %.0f TSC "
      "cycles (%.2fx)\n",
      v_after_v, v_after_t, v_after_t / v_after_v);
  release();
  return 0;
}
