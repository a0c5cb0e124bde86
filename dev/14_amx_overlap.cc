// Lab 14: can one thread overlap AMX tile products with the online softmax's vector work
// (issue 40)? FlashAttention-3 hides the softmax behind the tensor cores' products on a GPU;
// on a CPU that would need the tile unit to keep working while the AVX-512 ports run the
// exponentials. Three loops, each n times, by thread CPU time, best of the repeats:
//   tiles:    one 16 x 16 C tile of S as the kernel makes it (zero; 4 x (load A, load B,
//             tdpbf16ps); store), or, "no loads", 4 independent tdpbf16ps chains on tiles
//             already loaded (the probe's, the tile unit's best case);
//   softmax:  one row of 256 scores: P = 2^((S - m) log2 e), summed and stored (the library's
//             exponential form, simd_tile.h);
//   both:     the two interleaved, tile work first, so out-of-order execution may run them
//             side by side.
// If both ran side by side, "both" would take about the larger of the two; serialised, their sum.
// Exits 0 with a note where AMX-BF16 is not usable.
//   ./build/dev/lab_14_amx_overlap [n] [repeats]
#include <immintrin.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "kernel/amx_probe.h"
#include "lab_common.h"

namespace {

#define LAB_AMX __attribute__((target("amx-tile,amx-bf16,avx512f,avx512dq"), noinline))

alignas(64) uint16_t a_tiles[4][16 * 32], b_tiles[4][16 * 32];
alignas(64) float c_tile[16 * 16];
alignas(64) float scores[256];

LAB_AMX __m512 exp2_neg(__m512 t) {  // the library's form (simd_tile.h)
  static const float c[] = {1.0f,
                            6.931470632553101e-1f,
                            2.402293086051941e-1f,
                            5.5485282093286514e-2f,
                            9.675451554358006e-3f,
                            1.2467842316254973e-3f,
                            2.1612927957903594e-4f};
  const __m512 f = _mm512_reduce_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 p = _mm512_set1_ps(c[6]);
  for (int i = 5; i >= 0; --i) p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(c[i]));
  const __mmask16 normal = _mm512_cmp_ps_mask(t, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return _mm512_maskz_scalef_ps(normal, p, t);
}

// C (tile 0) += A B with A, B chunk k of the operands loaded into tiles ta, tb (a macro: the
// tile instructions take their tile numbers as literal register names).
#define LAB_LOAD_AND_MULTIPLY(ta, tb, k) \
  CTXPAR_TILE_LOAD(ta, a_tiles[k], 64);  \
  CTXPAR_TILE_LOAD(tb, b_tiles[k], 64);  \
  _tile_dpbf16ps(0, ta, tb)

enum Work { kTiles = 1, kSoftmax = 2, kNoLoads = 4 };

LAB_AMX double run(int work, long n) {
  __m512 sum = _mm512_setzero_ps();
  const __m512 vm = _mm512_set1_ps(2.0f), vlog2e = _mm512_set1_ps(1.4426950408889634f);
  const double t0 = lab::cpu_seconds();
  for (long i = 0; i < n; ++i) {
    if ((work & kTiles) && (work & kNoLoads)) {
      _tile_dpbf16ps(0, 4, 5);
      _tile_dpbf16ps(1, 4, 6);
      _tile_dpbf16ps(2, 7, 5);
      _tile_dpbf16ps(3, 7, 6);
    } else if (work & kTiles) {
      _tile_zero(0);
      LAB_LOAD_AND_MULTIPLY(1, 2, 0);
      LAB_LOAD_AND_MULTIPLY(3, 4, 1);
      LAB_LOAD_AND_MULTIPLY(5, 6, 2);
      LAB_LOAD_AND_MULTIPLY(1, 2, 3);
      CTXPAR_TILE_STORE(0, c_tile, 64);
    }
    if (work & kSoftmax)
      for (int c = 0; c < 256; c += 16) {
        const __m512 e =
            exp2_neg(_mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(scores + c), vm), vlog2e));
        sum = _mm512_add_ps(sum, e);
        _mm512_store_ps(scores + c, e);
      }
  }
  const double s = lab::cpu_seconds() - t0;
  volatile float sink = _mm512_reduce_add_ps(sum);
  (void)sink;
  return s;
}

LAB_AMX void start_tiles() { ctxpar::kernel::load_tile_config(ctxpar::kernel::kTiles16x64); }
LAB_AMX void load_operands() {  // tiles 4-7 for the "no loads" chains
  CTXPAR_TILE_LOAD(4, a_tiles[0], 64);
  CTXPAR_TILE_LOAD(5, b_tiles[0], 64);
  CTXPAR_TILE_LOAD(6, b_tiles[1], 64);
  CTXPAR_TILE_LOAD(7, a_tiles[1], 64);
}
LAB_AMX void release_tiles() { _tile_release(); }

}  // namespace

int main(int argc, char** argv) {
  const long n = argc > 1 ? std::atol(argv[1]) : 400000;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 3;
  if (n < 1 || repeats < 1) {
    std::fprintf(stderr, "usage: lab_14_amx_overlap [n >= 1] [repeats >= 1]\n");
    return 2;
  }
  if (!lab::amx_usable_or_say_why()) return 0;
  for (auto& t : a_tiles) std::fill(t, t + 16 * 32, uint16_t{0x3f80});  // 1.0
  for (auto& t : b_tiles) std::fill(t, t + 16 * 32, uint16_t{0x33d6});  // 1e-7
  for (int i = 0; i < 256; ++i) scores[i] = -0.1f * static_cast<float>(i % 50);
  start_tiles();
  for (const bool loads : {true, false}) {
    const int tiles = kTiles | (loads ? 0 : kNoLoads);
    double t = 1e30, s = 1e30, both = 1e30;
    for (int r = 0; r < repeats; ++r) {
      if (!loads) load_operands();
      t = std::min(t, run(tiles, n));
      s = std::min(s, run(kSoftmax, n));
      both = std::min(both, run(tiles | kSoftmax, n));
    }
    std::printf(
        "%s: tiles %.1f ms, softmax %.1f ms, interleaved %.1f ms = %.2f of their sum (%.2f if "
        "side by side)\n",
        loads ? "a C tile of S with its loads and store" : "4 tdpbf16ps chains, no loads", t * 1e3,
        s * 1e3, both * 1e3, both / (t + s), std::max(t, s) / (t + s));
  }
  release_tiles();
  return 0;
}
