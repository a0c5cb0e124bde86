// The exact bf16 products through AMX-BF16 tiles (simd_bf16.h: scores(..., amx = true)), used
// where the probe measured tile products paying (bf16_probe.cc) or CTXPAR_BF16_PRODUCTS=amx
// forces them. Compiled for AMX by target attributes only: the build needs no flag and runs on
// CPUs without AMX, where these are never called (the choice requires probe_amx's check, which
// also asked Linux for the tile state: arch_prctl(ARCH_REQ_XCOMP_PERM) is per process).
//
// The tile configuration is per thread, and other code on the same thread (the probe, or
// oneDNN's AMX kernels under torch in the same Python process) may load its own or release
// the tiles: so every call here loads ours before its first tile instruction and releases the
// tiles after its last (a few dozen cycles against the thousands of a call's tile products).
// One configuration serves everything: 8 tiles of 16 rows x 64 bytes.
// Tiles 0-3 are C (16 x 16 fp32), 4-5 A (16 rows x 16 pairs of Q or dO), 6-7 B (16 pair-rows x
// 16 key columns: a 16-column slice of the packed [pairs][64] key tile, rows 256 bytes apart).
#include <immintrin.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "ctxpar/kernel.h"
#include "kernel/amx_probe.h"
#include "kernel/simd_bf16.h"

namespace ctxpar::kernel::bf16 {

namespace {
constexpr int64_t kCols = kKernelTile;  // 64 key columns a packed tile
}  // namespace

#if defined(__x86_64__) && defined(__linux__)
namespace {

__attribute__((target("amx-tile,amx-bf16"))) void load_tiles() {
  TileConfig cfg;
  for (int i = 0; i < 8; ++i) cfg.rows[i] = 16, cfg.colsb[i] = 64;
  _tile_loadconfig(&cfg);
}

// C rows [0, 32) x columns [0, 32) (c0: rows 0-15, c1: rows 16-31, ldc floats a row) = A (a0:
// rows 0-15, a1: rows 16-31, lda words a row) times the 32 key columns at b; npairs a multiple
// of 16. Each C element: tile zeroed, then += 16 pairs a step, p = 0, 16, 32, ...
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void block(
    int64_t npairs, const uint32_t* a0, const uint32_t* a1, int64_t lda, const uint32_t* b,
    float* c0, float* c1, int64_t ldc) {
  _tile_zero(0);  // the tile macros are asm statements: one a statement
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t p = 0; p < npairs; p += 16) {
    _tile_loadd(4, a0 + p, lda * 4);
    _tile_loadd(5, a1 + p, lda * 4);
    _tile_loadd(6, b + p * kCols, kCols * 4);
    _tile_loadd(7, b + p * kCols + 16, kCols * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c0, ldc * 4);
  _tile_stored(1, c0 + 16, ldc * 4);
  _tile_stored(2, c1, ldc * 4);
  _tile_stored(3, c1 + 16, ldc * 4);
}

}  // namespace

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void scores_amx(
    int64_t m, int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b, float* c,
    float mul) {
  load_tiles();
  // A remainder of fewer than 32 rows is copied into zeroed rows, its C written here first.
  thread_local std::vector<uint32_t> a_tail;
  thread_local std::vector<float> c_tail;
  const __m512 vm = _mm512_set1_ps(mul);
  for (int64_t r = 0; r < m; r += 32) {
    const int64_t rows = std::min<int64_t>(32, m - r);
    const uint32_t* ap = a + r * lda;
    float* cp = c + r * kCols;
    if (rows < 32) {
      a_tail.assign(32 * lda, 0u);
      c_tail.resize(32 * kCols);
      std::memcpy(a_tail.data(), ap, static_cast<size_t>(rows * lda) * sizeof(uint32_t));
      ap = a_tail.data(), cp = c_tail.data();
    }
    for (int64_t n = 0; n < kCols; n += 32)
      block(npairs, ap, ap + 16 * lda, lda, b + n, cp + n, cp + 16 * kCols + n, kCols);
    if (mul != 1.0f || cp != c + r * kCols)  // S = mul * (Q K^T), as the vdpbf16ps path
      for (int64_t i = 0; i < rows * kCols; i += 16)
        _mm512_storeu_ps(c + r * kCols + i, _mm512_mul_ps(_mm512_loadu_ps(cp + i), vm));
  }
  _tile_release();
}

// One C element of a tile product (A row 0 = x, B column 0 = y; the rest zero), accumulated
// over npairs / 16 steps from a zeroed tile exactly as block() accumulates every element.
__attribute__((target("amx-tile,amx-bf16"))) float dot_pairs_amx(const uint32_t* x,
                                                                const uint32_t* y,
                                                                int64_t npairs) {
  load_tiles();
  alignas(64) uint32_t at[16 * 16] = {}, bt[16 * 16] = {};
  alignas(64) float ct[16 * 16];
  _tile_zero(0);
  for (int64_t p = 0; p < npairs; p += 16) {
    for (int i = 0; i < 16; ++i) at[i] = x[p + i], bt[i * 16] = y[p + i];
    _tile_loadd(4, at, 64);
    _tile_loadd(6, bt, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  _tile_stored(0, ct, 64);
  _tile_release();
  return ct[0];
}
#else
void scores_amx(int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, float*, float) {}
float dot_pairs_amx(const uint32_t*, const uint32_t*, int64_t) { return 0; }
#endif

}  // namespace ctxpar::kernel::bf16
