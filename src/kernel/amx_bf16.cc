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

void load_tiles() { load_tile_config(kTiles16x64); }

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
    CTXPAR_TILE_LOAD(4, a0 + p, lda * 4);
    CTXPAR_TILE_LOAD(5, a1 + p, lda * 4);
    CTXPAR_TILE_LOAD(6, b + p * kCols, kCols * 4);
    CTXPAR_TILE_LOAD(7, b + p * kCols + 16, kCols * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  CTXPAR_TILE_STORE(0, c0, ldc * 4);
  CTXPAR_TILE_STORE(1, c0 + 16, ldc * 4);
  CTXPAR_TILE_STORE(2, c1, ldc * 4);
  CTXPAR_TILE_STORE(3, c1 + 16, ldc * 4);
}

}  // namespace

__attribute__((target("amx-tile,amx-bf16,avx512f"))) void scores_amx(int64_t m, int64_t npairs,
                                                                     const uint32_t* a, int64_t lda,
                                                                     const uint32_t* b, float* c,
                                                                     float mul) {
  load_tiles();
  // A remainder of fewer than 32 rows is copied into zeroed rows, its C written here first.
  thread_local LineVector<uint32_t> a_tail;
  thread_local LineVector<float> c_tail;
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

// Note [P V, dV, dK, dQ through AMX]: with bf16 inputs, V, dO, Q and K are bf16 values, so
// the products with P and dS are products of bf16 values wherever P and dS are written as bf16
// values: forward O += P V; backward dV += P^T dO, dK += (scale dS)^T Q, dQ += (scale dS) K.
// Where the exact products run through AMX (p.amx), these run through tiles too:
//   - the fast tier rounds P and dS to one bf16 each (its documented rule, docs/kernel.md);
//   - the exact tier splits each fp32 value into 3 bf16 parts whose sum is the value exactly
//     (round_to_pairs), and the tiles add the three parts' exact products into the same fp32
//     accumulators: P and dS stay fp32 in effect, only the order of the fp32 additions
//     changes (as it does between vdpbf16ps and tdpbf16ps for S). Three tile products cost
//     less than one fp32 FMA product where tiles run well over 3x the FMA rate (docs/BENCHMARKS.md
//     has the probe's tile rates and the end-to-end gain).
// V, dO, Q and K are packed as VNNI pair-rows (pack_vnni); the fp32 accumulators (the
// forward's O rows, the backward's dV / dK block partials and dQ rows) are loaded into the C
// tiles and stored back. dK sums (scale dS)^T Q with the unscaled bf16 Q, so it needs no
// 1 / scale at the end. Rows and columns the tiles cover beyond the data are zero pairs in A
// or B: they add exact zeros to rows of the task's own tiles (padding rows and columns). One
// code path serves every transport, so threads, MPI and the simulator still get the same bits.

// C rows [0, 16 R) x columns [0, 16 N) (+)= A B, R, N in {1, 2}, in chunks of chunk_pairs pairs:
// A's chunk i at a + i a_chunk (rows lda words apart), B's at b[i] + col (pair-rows ldb words
// apart), C rows ldc floats apart.
// BP: B's parts (1, or 3 for fp32 operands: Note [fp32 through three bf16 parts]), b_part words
// apart; B's part j takes A's parts [0, nsplit - j) (BP 3), every part of A with BP 1.
template <int R, int N, int BP>
__attribute__((target("amx-tile,amx-bf16"), always_inline)) inline void gemm_block(
    int64_t nchunks, int64_t chunk_pairs, const uint32_t* a, int64_t lda, int64_t a_chunk,
    const uint32_t* const* b, int64_t col, int64_t ldb, float* c, int64_t ldc, bool accumulate,
    int nsplit, int64_t split_words, int64_t b_part) {
  if (accumulate) {
    CTXPAR_TILE_LOAD(0, c, ldc * 4);
    if constexpr (N == 2) CTXPAR_TILE_LOAD(1, c + 16, ldc * 4);
    if constexpr (R == 2) CTXPAR_TILE_LOAD(2, c + 16 * ldc, ldc * 4);
    if constexpr (R == 2 && N == 2) CTXPAR_TILE_LOAD(3, c + 16 * ldc + 16, ldc * 4);
  } else {
    _tile_zero(0);
    if constexpr (N == 2) _tile_zero(1);
    if constexpr (R == 2) _tile_zero(2);
    if constexpr (R == 2 && N == 2) _tile_zero(3);
  }
  // Chunk by chunk, 16 pairs a step (a division a step to find the chunk cost 15 % at 4 chunks).
  for (int64_t chunk = 0; chunk < nchunks; ++chunk) {
    for (int64_t pc = 0; pc < chunk_pairs; pc += 16)
      for (int j = 0; j < BP; ++j) {
        const uint32_t* bp = b[chunk] + j * b_part + pc * ldb + col;
        CTXPAR_TILE_LOAD(6, bp, ldb * 4);
        if constexpr (N == 2) CTXPAR_TILE_LOAD(7, bp + 16, ldb * 4);
        // Each part of A against the same B tiles; the second A tile is loaded after the first's
        // products are issued, so its load overlaps them (+2-4 % on the exact backward).
        const int parts = BP == 1 ? nsplit : nsplit - j;
        for (int sp = 0; sp < parts; ++sp) {
          const uint32_t* as = a + chunk * a_chunk + sp * split_words + pc;
          CTXPAR_TILE_LOAD(4, as, lda * 4);
          _tile_dpbf16ps(0, 4, 6);
          if constexpr (N == 2) _tile_dpbf16ps(1, 4, 7);
          if constexpr (R == 2) CTXPAR_TILE_LOAD(5, as + 16 * lda, lda * 4);
          if constexpr (R == 2) _tile_dpbf16ps(2, 5, 6);
          if constexpr (R == 2 && N == 2) _tile_dpbf16ps(3, 5, 7);
        }
      }
  }
  CTXPAR_TILE_STORE(0, c, ldc * 4);
  if constexpr (N == 2) CTXPAR_TILE_STORE(1, c + 16, ldc * 4);
  if constexpr (R == 2) CTXPAR_TILE_STORE(2, c + 16 * ldc, ldc * 4);
  if constexpr (R == 2 && N == 2) CTXPAR_TILE_STORE(3, c + 16 * ldc + 16, ldc * 4);
}

namespace {
template <int BP>
__attribute__((target("amx-tile,amx-bf16"))) void gemm_chunks(
    int64_t m, int64_t n, int64_t nchunks, int64_t chunk_pairs, const uint32_t* a, int64_t lda,
    int64_t a_chunk, const uint32_t* const* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
    int nsplit, int64_t split_words, int64_t b_part) {
  for (int64_t r = 0; r < m; r += 32) {
    const bool r2 = m - r >= 32;
    for (int64_t col = 0; col < n; col += 32) {
      const bool n2 = n - col >= 32;
      const uint32_t* ap = a + r * lda;
      float* cp = c + r * ldc + col;
      if (r2 && n2)
        gemm_block<2, 2, BP>(nchunks, chunk_pairs, ap, lda, a_chunk, b, col, ldb, cp, ldc,
                             accumulate, nsplit, split_words, b_part);
      else if (r2)
        gemm_block<2, 1, BP>(nchunks, chunk_pairs, ap, lda, a_chunk, b, col, ldb, cp, ldc,
                             accumulate, nsplit, split_words, b_part);
      else if (n2)
        gemm_block<1, 2, BP>(nchunks, chunk_pairs, ap, lda, a_chunk, b, col, ldb, cp, ldc,
                             accumulate, nsplit, split_words, b_part);
      else
        gemm_block<1, 1, BP>(nchunks, chunk_pairs, ap, lda, a_chunk, b, col, ldb, cp, ldc,
                             accumulate, nsplit, split_words, b_part);
    }
  }
}
}  // namespace

__attribute__((target("amx-tile,amx-bf16"))) void gemm_amx_chunks(
    int64_t m, int64_t n, int64_t nchunks, int64_t chunk_pairs, const uint32_t* a, int64_t lda,
    int64_t a_chunk, const uint32_t* const* b, int64_t ldb, float* c, int64_t ldc, bool accumulate,
    int nsplit, int64_t split_words, int b_parts, int64_t b_part) {
  load_tiles();
  if (b_parts == 3)
    gemm_chunks<3>(m, n, nchunks, chunk_pairs, a, lda, a_chunk, b, ldb, c, ldc, accumulate, nsplit,
                   split_words, b_part);
  else
    gemm_chunks<1>(m, n, nchunks, chunk_pairs, a, lda, a_chunk, b, ldb, c, ldc, accumulate, nsplit,
                   split_words, 0);
  _tile_release();
}

void gemm_amx(int64_t m, int64_t n, int64_t npairs, const uint32_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate, int nsplit,
              int64_t split_words) {
  gemm_amx_chunks(m, n, 1, npairs, a, lda, 0, &b, ldb, c, ldc, accumulate, nsplit, split_words);
}

__attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16"))) void round_to_pairs(
    const float* x, int64_t ldx, int64_t rows, int64_t npairs, uint32_t* out, int64_t ldw,
    int nsplit, int64_t split_words) {
  // Word indices that move bf16 value i (of the low or high 16) into the high half of 32-bit
  // lane i; the masked permute below zeroes the low halves, leaving the value's fp32 bits.
  alignas(64) static constexpr uint16_t kToHighLo[32] = {0,  0,  1,  1,  2,  2,  3,  3,  4,  4,  5,
                                                         5,  6,  6,  7,  7,  8,  8,  9,  9,  10, 10,
                                                         11, 11, 12, 12, 13, 13, 14, 14, 15, 15};
  alignas(64) static constexpr uint16_t kToHighHi[32] = {16, 16, 17, 17, 18, 18, 19, 19, 20, 20, 21,
                                                         21, 22, 22, 23, 23, 24, 24, 25, 25, 26, 26,
                                                         27, 27, 28, 28, 29, 29, 30, 30, 31, 31};
  const __m512i to_high_lo = _mm512_load_si512(kToHighLo);
  const __m512i to_high_hi = _mm512_load_si512(kToHighHi);
  for (int64_t r = 0; r < rows; ++r) {
    const float* xr = x + r * ldx;
    uint32_t* o = out + r * ldw;
    int64_t p = 0;
    for (; p + 16 <= npairs; p += 16) {  // 32 values: the first 16 the low halves' order
      __m512 lo = _mm512_loadu_ps(xr + 2 * p), hi = _mm512_loadu_ps(xr + 2 * p + 16);
      for (int sp = 0; sp < nsplit; ++sp) {
        const __m512bh v = _mm512_cvtne2ps_pbh(hi, lo);
        _mm512_storeu_si512(static_cast<void*>(o + sp * split_words + p), (__m512i)v);
        if (sp + 1 == nsplit) break;
        // What this part left, exact in fp32: x minus its nearest bf16 value (the result's low
        // 256 bits are lo's 16 values, the high 256 hi's).
        const __m512i w = (__m512i)v;
        const __m512i wl = _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high_lo, w);
        const __m512i wh = _mm512_maskz_permutexvar_epi16(0xAAAAAAAAu, to_high_hi, w);
        lo = _mm512_sub_ps(lo, _mm512_castsi512_ps(wl));
        hi = _mm512_sub_ps(hi, _mm512_castsi512_ps(wh));
      }
    }
    for (; p < npairs; ++p) {
      float lo = xr[2 * p], hi = xr[2 * p + 1];
      for (int sp = 0; sp < nsplit; ++sp) {
        const __m128bh v = _mm_cvtneps_pbh(_mm_set_ps(0, 0, hi, lo));
        uint32_t w;
        std::memcpy(&w, &v, sizeof w);
        o[sp * split_words + p] = w;
        const uint32_t wl = w << 16, wh = w & 0xffff0000u;
        float fl, fh;
        std::memcpy(&fl, &wl, sizeof fl), std::memcpy(&fh, &wh, sizeof fh);
        lo -= fl, hi -= fh;
      }
    }
  }
}

// Note [fp32 through three bf16 parts] (KernelConfig::fp32_products = parts: the forward's S and
// P V, the backward's S): an fp32 value x is the sum of three bf16 values h + m + l
// (round_to_pairs' split: h = x rounded to nearest even, m = (x - h) rounded, l = (x - h - m)
// rounded; each subtraction exact), so a product of fp32 operands a b is the sum of nine exact
// products of parts. The six with i + j < 3 (h h, h m, m h, h l, m m, l h) carry it: the three
// left out add up to at most about 2^-23 |a b| (each part at most 2^-8 of the one before), the
// size of the fp32 rounding of the sum itself. The tiles add the parts' products in fp32 as they
// add any pairs (tdpbf16ps), in a fixed order (gemm_block with BP 3), so threads, ranks and the
// backward's recomputed S get the forward's bits. dev/16_fp32_bf16x3.cc measures S and P V at
// 0.47 and 0.38 x 2^-23 sum |a b| from fp64 against the FMA products' 0.50 and 0.68, at 1.6 x
// their speed on this AMX CPU (TPUs emulate fp32 matrix products the same way). What differs
// from fp32 FMAs: bf16 tiles flush subnormals, so a part below 2^-126 is 0 (values below about
// 2^-102 keep fewer than 24 bits; a product of parts below 2^-126 adds 0): docs/kernel.md,
// "fp32 products".
__attribute__((target("avx512f,avx512vl,avx512bw,avx512bf16"))) void split_vnni(
    const float* src, int64_t ld, int64_t rows, int64_t d, int64_t ldb, uint32_t* out,
    int64_t part_words) {
  // Word c of a pair-row: bf16 value c (row 2i) in the low half, 16 + c (row 2i + 1) in the high.
  alignas(64) static constexpr uint16_t kInterleave[32] = {
      0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,  21, 6,  22, 7,  23,
      8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i interleave = _mm512_load_si512(kInterleave);
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xffff0000u));
  for (int64_t r = 0; r < rows; r += 2) {
    const float* a = src + r * ld;
    const float* b = r + 1 < rows ? a + ld : nullptr;
    uint32_t* dst = out + r / 2 * ldb;
    for (int64_t c = 0; c < d; c += 16) {
      const int64_t n = std::min<int64_t>(16, d - c);
      const __mmask16 m = n == 16 ? __mmask16(0xffff) : static_cast<__mmask16>((1u << n) - 1);
      __m512 x0 = _mm512_maskz_loadu_ps(m, a + c);
      __m512 x1 = b ? _mm512_maskz_loadu_ps(m, b + c) : _mm512_setzero_ps();
      for (int i = 0; i < 3; ++i) {
        const __m512i w =
            _mm512_permutexvar_epi16(interleave, (__m512i)_mm512_cvtne2ps_pbh(x1, x0));
        _mm512_mask_storeu_epi32(dst + i * part_words + c, m, w);
        // What this part left, exact in fp32 (low halves: row 2i's part; high: row 2i + 1's).
        // (The zero-masked shift: GCC 12 warns of its own undefined source in the plain one.)
        x0 = _mm512_sub_ps(x0, _mm512_castsi512_ps(_mm512_maskz_slli_epi32(0xffff, w, 16)));
        x1 = _mm512_sub_ps(x1, _mm512_castsi512_ps(_mm512_and_si512(w, high)));
      }
    }
  }
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
    CTXPAR_TILE_LOAD(4, at, 64);
    CTXPAR_TILE_LOAD(6, bt, 64);
    _tile_dpbf16ps(0, 4, 6);
  }
  CTXPAR_TILE_STORE(0, ct, 64);
  _tile_release();
  return ct[0];
}
#else
void scores_amx(int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, float*, float) {}
void gemm_amx_chunks(int64_t, int64_t, int64_t, int64_t, const uint32_t*, int64_t, int64_t,
                     const uint32_t* const*, int64_t, float*, int64_t, bool, int, int64_t, int,
                     int64_t) {}
void split_vnni(const float*, int64_t, int64_t, int64_t, int64_t, uint32_t*, int64_t) {}
void gemm_amx(int64_t, int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, float*,
              int64_t, bool, int, int64_t) {}
void round_to_pairs(const float*, int64_t, int64_t, int64_t, uint32_t*, int64_t, int, int64_t) {}
float dot_pairs_amx(const uint32_t*, const uint32_t*, int64_t) { return 0; }
#endif

}  // namespace ctxpar::kernel::bf16
