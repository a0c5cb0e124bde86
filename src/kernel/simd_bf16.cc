// The exact bf16 products (simd_bf16.h): packing bf16 rows and key tiles as pairs, and the
// vdpbf16ps micro-kernel. Compiled for AVX512_BF16 through target attributes only, so the rest
// of the build keeps its baseline and an AVX2-only CPU never reaches these (the dispatch in
// dispatch.cc turns bf16 products on only where the CPU has AVX512_BF16).
#include "kernel/simd_bf16.h"

#include <immintrin.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <vector>

#include "ctxpar/kernel.h"

namespace ctxpar::kernel::bf16 {

namespace {
constexpr int64_t kCols = kKernelTile;  // 64 columns: 4 vectors of 16 fp32 lanes
}  // namespace

uint32_t* buffer(Buffer slot, size_t words) {
  thread_local LineVector<uint32_t> buffers[static_cast<int>(Buffer::count)];
  LineVector<uint32_t>& b = buffers[static_cast<int>(slot)];
  if (b.size() < words) b.resize(words);
  return b.data();
}

void pack_rows(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
               int64_t ld, uint32_t* out, int64_t tile_rows) {
  std::fill(out, out + tile_rows * ld, 0u);
  for (int64_t r = 0; r < rows; ++r)
    std::memcpy(out + r * ld, t.ptr<const uint16_t>() + t.offset(b, i0 + r, h),
                static_cast<size_t>(d) * sizeof(uint16_t));  // little-endian: pair = (even, odd)
}

// Note [Packing by vectors]: packing a key tile's pairs (a transpose of 32-bit words) and V's
// VNNI pair-rows (two rows interleaved) word by word took 8 % of the bf16 forward once the tile
// products ran near their speed; the AVX-512 paths below (a 16-key gather a word column; a
// two-row word interleave) write the same words, checked against the loops they replace
// (pack_tile_words, pack_vnni_words; test Bf16Products.PackingByVectorsWritesTheLoopsWords).
namespace {

bool avx512bw() {
#if defined(__x86_64__)
  static const bool yes = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
  return yes;
#else
  return false;
#endif
}

#if defined(__x86_64__)
// Keys [0, cols) of rows ld values apart from src: their first np pairs, 16 keys a gather.
__attribute__((target("avx512f,avx512bw"))) void pack_tile_gather(const uint16_t* src, int64_t ld,
                                                                  int64_t cols, int64_t np,
                                                                  uint32_t* out) {
  const __m512i idx =
      _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                         _mm512_set1_epi32(static_cast<int>(ld)));
  for (int64_t c0 = 0; c0 < cols; c0 += 16) {
    const int64_t n = std::min<int64_t>(16, cols - c0);
    const __mmask16 m = static_cast<__mmask16>((1u << n) - 1);
    const uint16_t* base = src + c0 * ld;
    for (int64_t p = 0; p < np; ++p) {  // word p of each key: values 2p, 2p + 1 (little-endian)
      const __m512i w =
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), m, idx, base + 2 * p, 2);
      _mm512_mask_storeu_epi32(out + p * kCols + c0, m, w);
    }
  }
}

// Pair-row r / 2 of rows [0, rows) (ld values apart from src), d values a row: word c holds
// row 2i's value c (low half) and row 2i + 1's (high half, zero past rows).
__attribute__((target("avx512f,avx512bw"))) void pack_vnni_interleave(const uint16_t* src,
                                                                      int64_t ld, int64_t rows,
                                                                      int64_t d, int64_t ldb,
                                                                      uint32_t* out) {
  // Word j of the low (high) 16: value j (16 + j) of row a, then of row b (index 32 + ...).
  alignas(64) uint16_t lo_idx[32], hi_idx[32];
  for (uint16_t j = 0; j < 16; ++j) {
    lo_idx[2 * j] = j;
    lo_idx[2 * j + 1] = static_cast<uint16_t>(32 + j);
    hi_idx[2 * j] = static_cast<uint16_t>(16 + j);
    hi_idx[2 * j + 1] = static_cast<uint16_t>(48 + j);
  }
  const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
  for (int64_t r = 0; r < rows; r += 2) {
    const uint16_t* a = src + r * ld;
    const uint16_t* b = r + 1 < rows ? a + ld : nullptr;
    uint32_t* dst = out + r / 2 * ldb;
    for (int64_t c = 0; c < d; c += 32) {
      const int64_t n = std::min<int64_t>(32, d - c);
      const __mmask32 m = n == 32 ? ~__mmask32{0} : (__mmask32{1} << n) - 1;
      const __m512i va = _mm512_maskz_loadu_epi16(m, a + c);
      const __m512i vb = b ? _mm512_maskz_loadu_epi16(m, b + c) : _mm512_setzero_si512();
      const __mmask16 m0 = static_cast<__mmask16>(m), m1 = static_cast<__mmask16>(m >> 16);
      _mm512_mask_storeu_epi32(dst + c, m0, _mm512_permutex2var_epi16(va, lo, vb));
      if (m1 != 0)
        _mm512_mask_storeu_epi32(dst + c + 16, m1, _mm512_permutex2var_epi16(va, hi, vb));
    }
  }
}
#endif

}  // namespace

void pack_tile_words(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t cols, int64_t d,
                     uint32_t* out, bool amx) {
  const int64_t np = pairs(d);
  std::fill(out, out + stored_pairs(d, amx) * kCols, 0u);
  for (int64_t c = 0; c < cols; ++c) {
    const uint16_t* src = t.ptr<const uint16_t>() + t.offset(b, j0 + c, h);
    for (int64_t p = 0; p < d / 2; ++p)
      out[p * kCols + c] = static_cast<uint32_t>(src[2 * p]) | static_cast<uint32_t>(src[2 * p + 1])
                                                                   << 16;
    if (d % 2 != 0) out[(np - 1) * kCols + c] = src[d - 1];
  }
}

void pack_tile(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t cols, int64_t d,
               uint32_t* out, bool amx) {
#if defined(__x86_64__)
  // The gather's 32-bit indices: 15 row strides must fit (a view of a huge tensor takes the loop).
  if (avx512bw() && cols > 0 && t.stride(1) > 0 && t.stride(1) <= INT32_MAX / 16) {
    const int64_t np = pairs(d);
    std::fill(out, out + stored_pairs(d, amx) * kCols, 0u);
    const uint16_t* src = t.ptr<const uint16_t>() + t.offset(b, j0, h);
    pack_tile_gather(src, t.stride(1), cols, d / 2, out);
    if (d % 2 != 0)
      for (int64_t c = 0; c < cols; ++c) out[(np - 1) * kCols + c] = src[c * t.stride(1) + d - 1];
    return;
  }
#endif
  pack_tile_words(t, b, h, j0, cols, d, out, amx);
}

void pack_vnni_words(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
                     int64_t ldb, uint32_t* out, int64_t tile_rows) {
  std::fill(out, out + tile_rows / 2 * ldb, 0u);
  for (int64_t r = 0; r < rows; ++r) {
    const uint16_t* src = t.ptr<const uint16_t>() + t.offset(b, i0 + r, h);
    uint32_t* dst = out + r / 2 * ldb;
    const int shift = r % 2 == 0 ? 0 : 16;  // even row: the low half of the word
    for (int64_t c = 0; c < d; ++c) dst[c] |= static_cast<uint32_t>(src[c]) << shift;
  }
}

void pack_vnni(const TensorView& t, int64_t b, int64_t h, int64_t i0, int64_t rows, int64_t d,
               int64_t ldb, uint32_t* out, int64_t tile_rows) {
#if defined(__x86_64__)
  if (avx512bw() && rows > 0) {
    std::fill(out, out + tile_rows / 2 * ldb, 0u);
    pack_vnni_interleave(t.ptr<const uint16_t>() + t.offset(b, i0, h), t.stride(1), rows, d, ldb,
                         out);
    return;
  }
#endif
  pack_vnni_words(t, b, h, i0, rows, d, ldb, out, tile_rows);
}

void split_key_tile(const float* rows, int64_t np, uint32_t* words, uint32_t* out) {
  round_to_pairs(rows, 2 * np, kCols, np, words, np, 3, kCols * np);
  for (int i = 0; i < 3; ++i) {  // [c][p] -> [p][c]: a key tile's pairs, as pack_tile makes them
    const uint32_t* w = words + i * kCols * np;
    uint32_t* o = out + i * np * kCols;
#if defined(__x86_64__)
    if (avx512bw()) {  // the parts' CPUs (AMX) all have it
      pack_tile_gather(reinterpret_cast<const uint16_t*>(w), 2 * np, kCols, np, o);
      continue;
    }
#endif
    for (int64_t c = 0; c < kCols; ++c)
      for (int64_t p = 0; p < np; ++p) o[p * kCols + c] = w[c * np + p];
  }
}

#if defined(__x86_64__)
// Note [The fast tier through vdpbf16ps]: where the probe chose vdpbf16ps for the exact
// products (a CPU whose bf16 dot products beat its fp32 FMAs, e.g. AVX512_BF16 at 2 x the FMA
// FLOP/s), the fast tier's rounded P and dS are bf16 values too, so P V, dV, dK and dQ become
// products of bf16 pairs as well: A (P, P^T, dS, dS^T rounded, round_to_pairs) one pair
// broadcast, B (V, dO, Q, K) as the VNNI pair-rows the AMX path packs (pack_vnni), and R x NV
// fp32 accumulators (R rows, NV vectors of 16 columns) loaded from C and stored back: the same
// micro-kernel as the scores', whose B is a key tile (64 columns) and whose C starts at zero.
// The exact tier keeps fp32 P V there: its P as 3 bf16 parts would cost 3 / 2 of an fp32
// product.
namespace {

// R rows x NV vectors of 16 columns: R x NV fp32 accumulators (24 of 32 registers at 6 x 4),
// one broadcast pair of A and NV vectors of B per step; C = mul * (C or 0 + A B).
template <int R, int NV>
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline void micro(
    int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb, float* c,
    int64_t ldc, bool accumulate, float mul) {
  __m512 acc[R][NV];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j)
      acc[r][j] = accumulate ? _mm512_loadu_ps(c + r * ldc + j * 16) : _mm512_setzero_ps();
  for (int64_t p = 0; p < npairs; ++p) {
    __m512bh bv[NV];
    for (int j = 0; j < NV; ++j)
      bv[j] = (__m512bh)_mm512_loadu_si512(static_cast<const void*>(b + p * ldb + j * 16));
    for (int r = 0; r < R; ++r) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r * lda + p]));
      for (int j = 0; j < NV; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av, bv[j]);
    }
  }
  const __m512 vm = _mm512_set1_ps(mul);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < NV; ++j)
      _mm512_storeu_ps(c + r * ldc + j * 16, _mm512_mul_ps(acc[r][j], vm));
}

template <int R>
__attribute__((target("avx512f,avx512bf16"), always_inline)) inline void micro_row(
    int64_t n, int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b, int64_t ldb,
    float* c, int64_t ldc, bool accumulate, float mul) {
  for (int64_t col = 0; col < n; col += 64) {
    const uint32_t* bc = b + col;
    float* cc = c + col;
    switch (std::min<int64_t>(4, (n - col) / 16)) {
      case 4:
        micro<R, 4>(npairs, a, lda, bc, ldb, cc, ldc, accumulate, mul);
        break;
      case 3:
        micro<R, 3>(npairs, a, lda, bc, ldb, cc, ldc, accumulate, mul);
        break;
      case 2:
        micro<R, 2>(npairs, a, lda, bc, ldb, cc, ldc, accumulate, mul);
        break;
      default:
        micro<R, 1>(npairs, a, lda, bc, ldb, cc, ldc, accumulate, mul);
    }
  }
}

// C[m][n] = mul * (C or 0 + A B) over bf16 pairs: rows in blocks of 6, then 4, then 2 (m even).
__attribute__((target("avx512f,avx512bf16"))) void dot_gemm(int64_t m, int64_t n, int64_t npairs,
                                                            const uint32_t* a, int64_t lda,
                                                            const uint32_t* b, int64_t ldb,
                                                            float* c, int64_t ldc, bool accumulate,
                                                            float mul) {
  int64_t r = 0;
  for (; r + 6 <= m; r += 6)
    micro_row<6>(n, npairs, a + r * lda, lda, b, ldb, c + r * ldc, ldc, accumulate, mul);
  for (; r + 4 <= m; r += 4)
    micro_row<4>(n, npairs, a + r * lda, lda, b, ldb, c + r * ldc, ldc, accumulate, mul);
  for (; r < m; r += 2)
    micro_row<2>(n, npairs, a + r * lda, lda, b, ldb, c + r * ldc, ldc, accumulate, mul);
}

}  // namespace

void scores(int64_t m, int64_t npairs, const uint32_t* a, int64_t lda, const uint32_t* b, float* c,
            float mul, bool amx) {
  if (amx) return scores_amx(m, npairs, a, lda, b, c, mul);
  dot_gemm(m, kCols, npairs, a, lda, b, kCols, c, kCols, false, mul);
}

void gemm_dot(int64_t m, int64_t n, int64_t npairs, const uint32_t* a, int64_t lda,
              const uint32_t* b, int64_t ldb, float* c, int64_t ldc, bool accumulate) {
  dot_gemm(m, n, npairs, a, lda, b, ldb, c, ldc, accumulate, 1.0f);  // x 1: the same bits
}

namespace {
uint16_t bits16(float x, bool& exact) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  exact = exact && (u & 0xffffu) == 0;
  return static_cast<uint16_t>(u >> 16);
}

__attribute__((target("avx512f,avx512bf16"))) float dot_pairs(const uint32_t* x, const uint32_t* y,
                                                              int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t p = 0; p < n; ++p)
    acc = _mm512_dpbf16_ps(acc, (__m512bh)_mm512_set1_epi32(static_cast<int>(x[p])),
                           (__m512bh)_mm512_set1_epi32(static_cast<int>(y[p])));
  return _mm512_cvtss_f32(acc);
}
}  // namespace

float delta_dot(const float* o, const float* g, int64_t d, bool amx) {
  bool exact = true;
  const int64_t n = stored_pairs(d, amx);
  thread_local LineVector<uint32_t> x, y;  // O and dO as pairs, zero-padded
  x.assign(n, 0u), y.assign(n, 0u);
  for (int64_t c = 0; c < d && exact; c += 2) {
    x[c / 2] = bits16(o[c], exact) | (c + 1 < d ? uint32_t{bits16(o[c + 1], exact)} << 16 : 0u);
    y[c / 2] = bits16(g[c], exact) | (c + 1 < d ? uint32_t{bits16(g[c + 1], exact)} << 16 : 0u);
  }
  // dP = dO . V: dO the A row, V the key column.
  if (exact) return amx ? dot_pairs_amx(y.data(), x.data(), n) : dot_pairs(x.data(), y.data(), n);
  float sum = 0;
  for (int64_t c = 0; c < d; c += 2) {
    if (c + 1 < d) sum = sum + o[c + 1] * g[c + 1];  // -ffp-contract=off: rounded, then added
    sum = sum + o[c] * g[c];
  }
  return sum;
}
#else
void scores(int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, float*, float, bool) {}
void gemm_dot(int64_t, int64_t, int64_t, const uint32_t*, int64_t, const uint32_t*, int64_t, float*,
              int64_t, bool) {}
float delta_dot(const float*, const float*, int64_t, bool) { return 0; }
#endif

}  // namespace ctxpar::kernel::bf16
