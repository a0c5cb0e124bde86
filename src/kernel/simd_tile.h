// Private SIMD building blocks of the fast path (Google Highway, dynamic dispatch: every file
// that includes this one is compiled once per SIMD target through hwy/foreach_target.h, and
// the best target the CPU runs -- or a lower one CTXPAR_SIMD asks for -- is chosen at run
// time; see dispatch.cc):
//   - gemm_rows: C[M x N] (+)= A[M x K] * B[K x N], A read by broadcast, B by rows of vectors,
//     register-blocked 6 rows x up to 4 vectors (per target), the one micro-kernel behind
//     all five products of forward and backward (S = Q K^T, O += P V, dP = dO V^T, ...);
//   - exp2 over a vector: 2^t for t <= 0 with exact 0 below 2^-126 and for -inf;
//   - tile packing of K / V (transposed or row-major, zero-padded).
// Per-target include guard (Highway's idiom): re-opened for each target of foreach_target.h.
#if defined(CTXPAR_KERNEL_SIMD_TILE_H_) == defined(HWY_TARGET_TOGGLE)
#ifdef CTXPAR_KERNEL_SIMD_TILE_H_
#undef CTXPAR_KERNEL_SIMD_TILE_H_
#else
#define CTXPAR_KERNEL_SIMD_TILE_H_
#endif

#include <hwy/highway.h>
#if HWY_ARCH_X86
#include <immintrin.h>  // transpose_16x16
#endif

#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kernel/asan_regions.h"
#include "kernel/lines.h"
#include "kernel/problem.h"

HWY_BEFORE_NAMESPACE();
namespace ctxpar::kernel::HWY_NAMESPACE {

namespace hn = hwy::HWY_NAMESPACE;
using DF = hn::ScalableTag<float>;
using VF = hn::Vec<DF>;

constexpr int64_t kTile = kKernelTile;  // query and key tile (the scalar path's: same tile stats)
constexpr float kLog2e = 1.4426950408889634f;

inline int64_t lanes() { return static_cast<int64_t>(hn::Lanes(DF())); }
inline int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// 2^t for t <= 0 (and up to 127 on AVX-512; exp2_capped below for t above 0); exactly 0 for
// t < -126 (-inf included). Range reduction t = n + f with
// n = floor(t), f in [0, 1), then 2^f by the minimax polynomial 1 + f q(f) of degree 6 (relative
// error 2e-9 in exact arithmetic, 6.4e-8 evaluated in fp32, as the degree-7 Taylor polynomial on
// [-1/2, 1/2] it replaced, with one FMA fewer; p(0) = 1 exactly, so P = 1 at the row's max),
// times 2^n. dev/13_exp2.cc fitted and timed it (issue 40). Every target takes the same f, the
// same polynomial and gives 0 below -126, so their bits agree (where MulAdd is fused).
HWY_INLINE VF exp2_poly(DF d, VF f) {
  VF p = hn::Set(d, 2.1612927957903594e-4f);
  p = hn::MulAdd(p, f, hn::Set(d, 1.2467842316254973e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 9.675451554358006e-3f));
  p = hn::MulAdd(p, f, hn::Set(d, 5.5485282093286514e-2f));
  p = hn::MulAdd(p, f, hn::Set(d, 2.402293086051941e-1f));
  p = hn::MulAdd(p, f, hn::Set(d, 6.931470632553101e-1f));
  return hn::MulAdd(p, f, hn::Set(d, 1.0f));
}
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
// AVX-512: vreduceps gives f = t - floor(t) in one instruction (exact), and vscalefps scales
// by 2^floor(t) itself. Lanes with t < -126 are zeroed by the scaling's mask instead of
// underflowing: a result below 2^-126 (a denormal, or 0 by underflow) takes a microcode assist,
// ~35x a vector's time here, and the masked scores of a causal or document tile (-inf, which
// the old clamp at -150 turned into an underflow) are a quarter to a half of a diagonal tile's
// (lab 13). The other targets give 0 there too, so the bits agree with them everywhere.
HWY_INLINE VF exp2_neg(DF d, VF t) {
  const __m512 f = _mm512_reduce_ps(t.raw, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __mmask16 normal = _mm512_cmp_ps_mask(t.raw, _mm512_set1_ps(-126.0f), _CMP_GE_OQ);
  return VF{_mm512_maskz_scalef_ps(normal, exp2_poly(d, VF{f}).raw, t.raw)};
}
#else
// Elsewhere: 2^n built in the exponent bits. Clamping at -127 makes n + 127 = 0 for anything
// below -126 (and -inf): exponent bits 0 with a zero mantissa, exactly 0 (no denormal).
HWY_INLINE VF exp2_neg(DF d, VF t) {
  const hn::RebindToSigned<DF> di;
  t = hn::Max(t, hn::Set(d, -127.0f));
  const VF n = hn::Floor(t);
  const VF p = exp2_poly(d, hn::Sub(t, n));
  const auto bits = hn::ShiftLeft<23>(hn::Add(hn::ConvertTo(di, n), hn::Set(di, 127)));
  return hn::Mul(p, hn::BitCast(d, bits));
}
#endif

// 2^t for t <= 12, and some value above 2^12 for t above 12 (+inf included): the forward's
// softmax takes scores above its row's base, where any P above kBaseSlack (2^8) only moves the
// base (Note [A row's base]). AVX-512 gives 2^t itself (inf past 127); elsewhere t is clamped at
// 13, or the exponent bits of 2^n would overflow into the sign. Both give the same bits up to 12.
HWY_INLINE VF exp2_capped(DF d, VF t) {
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
  return exp2_neg(d, t);
#else
  return exp2_neg(d, hn::Min(t, hn::Set(d, 13.0f)));
#endif
}

// Kahan's step of Note [Blocked dK / dV] for one vector of a block partial: sum and comp in
// memory, y = part - comp; t = sum + y; comp = (t - sum) - y; sum = t (add_compensated, and the
// epilogue of micro<..., KS>, which must give the same bits).
HWY_INLINE void kahan_step(DF d, VF part, float* HWY_RESTRICT sum, float* HWY_RESTRICT comp) {
  const VF s = hn::LoadU(d, sum);
  const VF y = hn::Sub(part, hn::LoadU(d, comp));
  const VF t = hn::Add(s, y);
  hn::StoreU(hn::Sub(hn::Sub(t, s), y), d, comp);
  hn::StoreU(t, d, sum);
}

// R rows x C vectors of C: acc over k of A[r][k] * B[k][c]. A row stride lda, B row stride ldb
// (floats, B rows 64-byte friendly), C row stride ldc. accumulate = false overwrites C.
// AT: A given transposed (A[r][k] at a[k lda + r]), as the backward's P and dS for dV and dK.
template <int R, int C, bool AT = false, bool KS = false>
CTXPAR_REGION_CHECKED HWY_INLINE void micro(const float* HWY_RESTRICT a, int64_t lda,
                                            const float* HWY_RESTRICT b, int64_t ldb, int64_t k,
                                            float* HWY_RESTRICT c, int64_t ldc, bool accumulate,
                                            float* HWY_RESTRICT sum = nullptr,
                                            float* HWY_RESTRICT comp = nullptr) {
  const DF d;
  const int64_t n = lanes();
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j)
      acc[r][j] = accumulate ? hn::LoadU(d, c + r * ldc + j * n) : hn::Zero(d);
  for (int64_t x = 0; x < k; ++x) {
    VF bv[C];
    for (int j = 0; j < C; ++j) bv[j] = hn::LoadU(d, b + x * ldb + j * n);
    for (int r = 0; r < R; ++r) {
      const VF av = hn::Set(d, AT ? a[x * lda + r] : a[r * lda + x]);
      for (int j = 0; j < C; ++j) acc[r][j] = hn::MulAdd(av, bv[j], acc[r][j]);
    }
  }
  if constexpr (KS) {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) {
        const int64_t o = r * ldc + j * n;
        kahan_step(d, acc[r][j], sum + o, comp + o);
      }
  } else {
    for (int r = 0; r < R; ++r)
      for (int j = 0; j < C; ++j) hn::StoreU(acc[r][j], d, c + r * ldc + j * n);
  }
}

// R rows of C against all N columns: micro-kernels of kC vectors, then single vectors.
template <int R, int kC>
CTXPAR_REGION_CHECKED HWY_INLINE void row_block(int64_t n, int64_t k, const float* a, int64_t lda,
                                                const float* b, int64_t ldb, float* c, int64_t ldc,
                                                bool accumulate) {
  const int64_t nl = lanes();
  int64_t j = 0;
  for (; j + kC * nl <= n; j += kC * nl)
    micro<R, kC>(a, lda, b + j, ldb, k, c + j, ldc, accumulate);
  for (; j < n; j += nl) micro<R, 1>(a, lda, b + j, ldb, k, c + j, ldc, accumulate);
}

// The register blocks of C[M x N] (+)= A B without K panels: columns in kC-vector strips, each
// strip's rows 6 (then 4, 2) at a time. AT: A given transposed (row r of A is column r at a + r).
template <bool AT, bool KS = false>
CTXPAR_REGION_CHECKED HWY_INLINE void gemm_blocks(int64_t m, int64_t n, int64_t k, const float* a,
                                                  int64_t lda, const float* b, int64_t ldb,
                                                  float* c, int64_t ldc, bool accumulate,
                                                  float* sum = nullptr, float* comp = nullptr) {
  const int64_t nl = lanes(), ar = AT ? 1 : lda;  // A's row step
  constexpr int kC = HWY_MAX_BYTES >= 64 ? 4 : 2;
  constexpr int kR = 6;
  // The R x C block at row r, column j (KS: its sum and comp where C's would be).
  auto block = [&](auto rows, auto cols, int64_t r, int64_t j) {
    const int64_t o = r * ldc + j;
    micro<decltype(rows)::value, decltype(cols)::value, AT, KS>(
        a + r * ar, lda, b + j, ldb, k, c + o, ldc, accumulate, KS ? sum + o : nullptr,
        KS ? comp + o : nullptr);
  };
  using R6 = std::integral_constant<int, kR>;
  using R4 = std::integral_constant<int, 4>;
  using R2 = std::integral_constant<int, 2>;
  using C4 = std::integral_constant<int, kC>;
  using C1 = std::integral_constant<int, 1>;
  int64_t j = 0;
  for (; j + kC * nl <= n; j += kC * nl) {
    int64_t r = 0;
    for (; r + kR <= m; r += kR) block(R6{}, C4{}, r, j);
    for (; r + 4 <= m; r += 4) block(R4{}, C4{}, r, j);
    for (; r < m; r += 2) block(R2{}, C4{}, r, j);
  }
  for (; j < n; j += nl) {
    int64_t r = 0;
    for (; r + 4 <= m; r += 4) block(R4{}, C1{}, r, j);
    for (; r < m; r += 2) block(R2{}, C1{}, r, j);
  }
}

// C[M x N] (+)= A[M x K] B[K x N]; M a multiple of 2, N a multiple of the lane count.
// The shape is chosen per target (HWY_MAX_BYTES is the compiled target's vector size):
// AVX-512 (32 registers): 6 rows x 4 vectors = 24 accumulators, 1 load of B per 6 FMAs.
// AVX2 / SSE4 (16 registers): 6 rows x 2 vectors = 12 accumulators + 2 B vectors + 1 broadcast.
//
// Note [K panels]: with 0 < k_panel < K the product runs in panels of k_panel rows of B (and
// columns of A), and within a panel row block by row block, each block against every column:
// the B panel (k_panel x N floats) is what the micro-kernels stream again and again, so it is
// sized to stay in L1 (kernel_k_panel) -- a whole 128 x 64 K^T tile is 32 KiB, all of a Zen 3
// L1, and without panels about one load in six missed it there (cachegrind, Zen 3 geometry:
// docs/kernel.md). The bits do not change: every element of C still gets its FMAs in the order
// k = 0, 1, ..., K-1 from the same start, only with an exact fp32 store and reload of the
// accumulator between panels.
// Under a sanitizer build the regions are checked once per call (Note [Hot loops under
// AddressSanitizer]): rows of A and C rounded up to 2, columns of B and C to the lane count.
CTXPAR_REGION_CHECKED inline void gemm_rows(int64_t m, int64_t n, int64_t k, const float* a,
                                            int64_t lda, const float* b, int64_t ldb, float* c,
                                            int64_t ldc, bool accumulate, int64_t k_panel = 0) {
  const int64_t mr = round_up(m, 2), nr = round_up(n, lanes());
  check_rows(a, mr, k * 4, lda * 4, false);
  check_rows(b, k, nr * 4, ldb * 4, false);
  check_rows(c, mr, nr * 4, ldc * 4, true);
  if (k_panel > 0 && k_panel < k) {
    constexpr int kC = HWY_MAX_BYTES >= 64 ? 4 : 2;
    constexpr int kR = 6;
    for (int64_t k0 = 0; k0 < k; k0 += k_panel) {
      const int64_t kk = std::min(k_panel, k - k0);
      const bool acc = accumulate || k0 > 0;
      const float* ap = a + k0;
      const float* bp = b + k0 * ldb;
      int64_t r = 0;
      for (; r + kR <= m; r += kR)
        row_block<kR, kC>(n, kk, ap + r * lda, lda, bp, ldb, c + r * ldc, ldc, acc);
      for (; r + 4 <= m; r += 4)
        row_block<4, kC>(n, kk, ap + r * lda, lda, bp, ldb, c + r * ldc, ldc, acc);
      for (; r < m; r += 2)
        row_block<2, kC>(n, kk, ap + r * lda, lda, bp, ldb, c + r * ldc, ldc, acc);
    }
    return;
  }
  gemm_blocks<false>(m, n, k, a, lda, b, ldb, c, ldc, accumulate);
}

// C[M x N] (+)= A B with A given transposed: A[r][x] at at[x lda + r] (k rows of lda floats, M
// of them used), as gemm_rows makes it otherwise (the same FMAs in the same order, so the same
// bits as gemm_rows on the transposed copy): the backward's dV += P^T dO and dK += dS^T Qs read
// P and dS where softmax_gradient left them, with no transposed copies.
CTXPAR_REGION_CHECKED inline void gemm_rows_at(int64_t m, int64_t n, int64_t k, const float* at,
                                               int64_t lda, const float* b, int64_t ldb, float* c,
                                               int64_t ldc, bool accumulate) {
  const int64_t mr = round_up(m, 2), nr = round_up(n, lanes());
  check_rows(at, k, mr * 4, lda * 4, false);
  check_rows(b, k, nr * 4, ldb * 4, false);
  check_rows(c, mr, nr * 4, ldc * 4, true);
  gemm_blocks<true>(m, n, k, at, lda, b, ldb, c, ldc, accumulate);
}

// C's partial (accumulated) + A B with A given transposed, added to (sum, comp) by Kahan's step
// (kahan_step, as add_compensated) instead of stored in C: the last tile of a dK / dV
// block and the block's flush in one pass.
CTXPAR_REGION_CHECKED inline void gemm_rows_at_compensated(int64_t m, int64_t n, int64_t k,
                                                           const float* at, int64_t lda,
                                                           const float* b, int64_t ldb, float* c,
                                                           int64_t ldc, float* sum, float* comp) {
  const int64_t mr = round_up(m, 2), nr = round_up(n, lanes());
  check_rows(at, k, mr * 4, lda * 4, false);
  check_rows(b, k, nr * 4, ldb * 4, false);
  check_rows(c, mr, nr * 4, ldc * 4, false);
  check_rows(sum, mr, nr * 4, ldc * 4, true);
  check_rows(comp, mr, nr * 4, ldc * 4, true);
  gemm_blocks<true, true>(m, n, k, at, lda, b, ldb, c, ldc, true, sum, comp);
}

// Note [Padded rows]: the row stride of the packed [rows][dp] buffers (Q, dO, V, K rows, the
// output accumulators, dK / dV tiles). At D = 128 a row is 512 bytes, so consecutive rows map
// to every 8th set of a 64-set L1, and the 64 rows of a tile's column block share 8 sets: a
// micro-kernel streaming one column block of V (or dO, Q, K) while updating the same block of
// its accumulator wanted ~20 lines in 8-way sets, and missed L1 on about one load in five under
// Zen 3's geometry (cachegrind; docs/kernel.md). One extra cache line a row spreads the rows
// over all sets. The padding is never read into a result: bits do not change.
inline int64_t padded_ld(int64_t dp) {
  return (dp * static_cast<int64_t>(sizeof(float))) % 256 == 0 ? dp + 16 : dp;
}

// The tiles of one fast-path call, forward or backward: the query and key tiles' ranges, D
// rounded up to the lanes and the padded row stride of the [rows][dp] tiles, and the K panel
// rows of its S = Q K^T (and dP = dO V^T) products.
struct CallTiles {
  TileRanges qr, kr;
  int64_t d = 0, dp = 0, nkt = 0, nqt = 0, ld = 0, k_panel = 0;
};
inline CallTiles call_tiles(const Problem& p, const Tokens& q_tokens, const Tokens& k_tokens,
                            const Mask& mask) {
  CallTiles t;
  t.qr = tile_ranges(q_tokens, p.tq, kTile, mask.documents);
  t.kr = tile_ranges(k_tokens, p.tk, kTile, mask.documents);
  t.d = p.d, t.dp = round_up(p.d, lanes()), t.nkt = t.kr.count(), t.nqt = t.qr.count();
  t.ld = padded_ld(t.dp);
  t.k_panel = kernel_k_panel(kTile, t.d, p.l1d_bytes);
  return t;
}

// Packs rows [j0, j0 + cols) of one (batch, head) of t [B, T, H, D] as a zero-padded tile:
// transposed [D][kTile] (for A * B^T products) or row-major [tile_rows][ld] (ld >= d floats a
// row; tile_rows >= rows, kTile unless given).
inline void pack_transposed(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t cols,
                            int64_t d, float* out, float* row) {
  std::fill(out, out + d * kTile, 0.0f);
  for (int64_t j = 0; j < cols; ++j) {
    if (j + kRowsAhead < cols) prefetch_row(t, t.offset(b, j0 + j + kRowsAhead, h), d);
    load_row(t, t.offset(b, j0 + j, h), d, row);
    for (int64_t c = 0; c < d; ++c) out[c * kTile + j] = row[c];
  }
}
inline void pack_rows(const TensorView& t, int64_t b, int64_t h, int64_t j0, int64_t rows,
                      int64_t d, int64_t ld, float* out, float mul = 1.0f,
                      int64_t tile_rows = kTile) {
  std::fill(out, out + tile_rows * ld, 0.0f);
  for (int64_t j = 0; j < rows; ++j) {
    if (j + kRowsAhead < rows) prefetch_row(t, t.offset(b, j0 + j + kRowsAhead, h), d);
    load_row(t, t.offset(b, j0 + j, h), d, out + j * ld);
    if (mul != 1.0f)
      for (int64_t c = 0; c < d; ++c) out[j * ld + c] *= mul;
  }
}

// The slices of a slice mask that touch one tile (mask_tile below), and the masking of a score
// row by their union.
struct SliceFilter {
  std::vector<MaskSlice> touching;
  void select(const Mask& mask, const Tokens& q_tokens, int64_t i0, int64_t rows, const int64_t* kp,
              int64_t cols) {
    int64_t qa = kInt64Max, qb = kInt64Min, ka = kInt64Max, kb = kInt64Min;
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t p = q_tokens.positions[i0 + r];
      if (p != kPaddingPosition) qa = std::min(qa, p), qb = std::max(qb, p);
    }
    for (int64_t c = 0; c < cols; ++c)
      if (kp[c] != kPaddingPosition) ka = std::min(ka, kp[c]), kb = std::max(kb, kp[c]);
    if (qa > qb || ka > kb) return;
    for (const MaskSlice& s : mask.slice_list())
      if (s.touches(qa, qb, ka, kb)) touching.push_back(s);
  }
  // Hides every column of score row `sr` (query position pq) that no touching slice shows.
  void apply(int64_t pq, const int64_t* kp, int64_t cols, float* sr) const {
    int64_t lo[kTile], hi[kTile];
    int n = 0;
    for (const MaskSlice& s : touching)
      if (pq >= s.q_lo && pq < s.q_hi && n < kTile) lo[n] = s.k_lo, hi[n] = s.key_hi(pq), ++n;
    if (n == kTile) {  // more slices on one row than a tile has keys: column by column
      for (int64_t c = 0; c < cols; ++c) {
        bool shown = false;
        for (const MaskSlice& s : touching) shown = shown || s.shows(pq, kp[c]);
        sr[c] = shown ? sr[c] : kNegInf;
      }
      return;
    }
    for (int64_t c = 0; c < cols; ++c) {
      bool shown = false;
      for (int i = 0; i < n; ++i) shown = shown || (kp[c] >= lo[i] && kp[c] <= hi[i]);
      sr[c] = shown ? sr[c] : kNegInf;
    }
  }
};

// Sets the masked scores of a rows x kTile score tile (row stride kTile) to -inf: columns at
// or beyond `cols`, and when `partial`, every (i0 + r, j0 + c) pair the mask hides. The loop
// is branch-free over the columns so the compiler vectorises it (the diagonal tiles of a
// causal mask would otherwise cost about as much as their matrix products).
inline void mask_tile(float* s, int64_t rows, int64_t cols, bool partial, const Mask& mask,
                      const Tokens& q_tokens, int64_t i0, const Tokens& k_tokens, int64_t j0) {
  const int64_t* kp = k_tokens.positions.data() + j0;
  const int32_t* kd = mask.documents ? k_tokens.documents.data() + j0 : nullptr;
  const bool docs = mask.documents;
  // A slice mask: the slices that touch this tile (most touch none), then per row the union of
  // their key intervals (mask_rules.h's MaskSlice).
  SliceFilter sf;
  if (partial && mask.sliced) sf.select(mask, q_tokens, i0, rows, kp, cols);
  for (int64_t r = 0; r < rows; ++r) {
    float* sr = s + r * kTile;
    if (partial) {
      // The row's visible key positions [lo, hi], saturated at the ends of int64 (Mask::key_range):
      // no subtraction of positions here, so no overflow anywhere in the int64 range.
      const int64_t pq = q_tokens.positions[i0 + r];
      if (pq == kPaddingPosition) {  // a padding query sees nothing
        std::fill(sr, sr + kTile, kNegInf);
        continue;
      }
      const Mask::KeyRange kr = mask.key_range(pq);
      const int32_t dq = docs ? q_tokens.documents[i0 + r] : 0;
      for (int64_t c = 0; c < cols; ++c) {
        bool seen = kp[c] != kPaddingPosition && kp[c] >= kr.lo && kp[c] <= kr.hi;
        if (docs) seen = seen && kd[c] == dq;
        sr[c] = seen ? sr[c] : kNegInf;
      }
      if (mask.sliced) sf.apply(pq, kp, cols, sr);
    }
    for (int64_t c = cols; c < kTile; ++c) sr[c] = kNegInf;
  }
}

// Note [A row's base]: a row's exponentials are taken against its base m, not its running max:
// the base is set to the max at the row's first visible step, and moved to the max again only
// where a later step's P outgrow it, as FlashAttention-4 rescales lazily. Most steps then need
// no pass over the scores before their exponentials (the separate max pass cost the bf16 fast
// forward 11-17 %: docs/kernel.md, "Round twelve"): the exponentials against the base are
// summed lane by lane as before, and where no lane's sum of the step exceeds kBaseSlack (2^8)
// that is all. Each lane sums a P of every 16th key, so then every P <= 2^8; and a P above 2^8
// (a score more than 8 ln 2 = 5.5 above the base, or +inf) always moves the base. Where the base
// moves, the row is done again as a first step is, from `keep` (the scores the exponent pass
// copied: one L1-resident row): its max, the rescale of l and acc, its exponentials against the
// new base, so with the same bits as if that step had been the row's first at that base. So
// P <= 2^8 and l >= 1 (the base's own score gave P = 1 when it was set, and l is rescaled with
// it). The finalize's LSE = m + log l (in double: log l is up to 5.5 + log T) and a merge's
// rescale take any base; exp(S - LSE) in the backward is unchanged. What it costs: the bound on
// acc is 2^8 T max |V| (it was T max |V|; fp32's range for |V| < 3e32 at T = 4096, and a
// non-finite O is an error: docs/faults.md), and a row's largest P, whose exponent t was about
// 0, now has t up to 8, whose fp32 rounding (|t| 2^-24) adds up to 8 ulps to that P's error:
// the kernel tests' errors against fp64 moved within their rules (docs/kernel.md). Only the AMX
// path's key steps take it (Note [Key steps], simd_forward.cc: softmax_row<kLazy = true>); the
// fp32 path's one-tile steps keep the max first, and their bits (there the copy to `keep` cost
// more than a max pass over 4 vectors in L1: -2 %).
constexpr float kBaseSlack = 256.0f;

// One row of the forward's online softmax over `blocks` 64-key score tiles (simd_forward.cc,
// Note [Scores in natural units, exponents in base 2]; more than one: Note [Key steps] there),
// tile i's kTile scores at sr + i stride: they become P; the row's base `m` (Note [A row's
// base]), its lane-wise sums `lv` (one vector) and its accumulator `acc` (dp floats) are
// rescaled when the base moves. kLazy: the base stays within its slack (`keep`: blocks x kTile
// floats of scratch); else the base is the running max, found first at every step (`keep`
// unused). A row that has seen nothing yet gets P = 0, state unchanged. One
// tile takes the same operations in the same order whatever `stride` is. kScaled: the scores
// are mul times the values in `sr`, each product rounded once to fp32 as a separate pass storing
// them would (mul > 0, so the max of the products is the product of the max: m and P keep their
// bits and the pass over S is saved).
template <bool kLazy, bool kScaled = false>
HWY_INLINE void softmax_row(float* HWY_RESTRICT sr, float& m, float* HWY_RESTRICT lv,
                            float* HWY_RESTRICT acc, int64_t dp, float* HWY_RESTRICT keep,
                            int64_t blocks = 1, int64_t stride = 0, float mul = 1.0f) {
  const DF df;
  const int64_t nl = lanes();
  const VF vlog2e = hn::Set(df, kLog2e), vmul = hn::Set(df, mul);
  // P = 2^((x - base) log2 e) of the scores x at src (tile i at src + i src_stride, times mul
  // where kMul; copied to keep where kKeep) into sr; returns their lane-wise sums.
  const auto exponentials = [&](const float* src, int64_t src_stride, auto mul_tag, auto keep_tag,
                                float base) {
    constexpr bool kMul = decltype(mul_tag)::value, kKeep = decltype(keep_tag)::value;
    const VF vm = hn::Set(df, base);
    VF vsum = hn::Zero(df);
    for (int64_t i = 0; i < blocks; ++i)
      for (int64_t c = 0; c < kTile; c += nl) {
        VF x = hn::LoadU(df, src + i * src_stride + c);
        if constexpr (kMul) x = hn::Mul(x, vmul);
        if constexpr (kKeep) hn::StoreU(x, df, keep + i * kTile + c);
        const VF t = hn::Mul(hn::Sub(x, vm), vlog2e);  // above 0 only against a base
        const VF e = kKeep ? exp2_capped(df, t) : exp2_neg(df, t);
        vsum = hn::Add(vsum, e);
        hn::StoreU(e, df, sr + i * stride + c);
      }
    return vsum;
  };
  const float* src = sr;  // the scores a max pass and new base read
  int64_t src_stride = stride;
  bool scaled = kScaled;
  if (kLazy && m != kNegInf) {  // against the base (a NaN lane sum keeps it: its LSE is NaN)
    const VF vsum = exponentials(sr, stride, std::bool_constant<kScaled>{}, std::true_type{}, m);
    if (!(hn::GetLane(hn::MaxOfLanes(df, vsum)) > kBaseSlack)) {
      hn::StoreU(hn::Add(vsum, hn::LoadU(df, lv)), df, lv);
      return;
    }
    src = keep, src_stride = kTile, scaled = false;  // the scores, already times mul
  }
  VF vmax = hn::LoadU(df, src);
  for (int64_t i = 0; i < blocks; ++i)
    for (int64_t c = i == 0 ? nl : 0; c < kTile; c += nl)
      vmax = hn::Max(vmax, hn::LoadU(df, src + i * src_stride + c));
  float row_max = hn::GetLane(hn::MaxOfLanes(df, vmax));
  if (scaled) row_max *= mul;
  const float m_new = std::max(m, row_max);
  if (m_new == kNegInf) {  // nothing visible to this row yet
    for (int64_t i = 0; i < blocks; ++i) std::fill_n(sr + i * stride, kTile, 0.0f);
    return;
  }
  if (m_new > m) {  // the base moves: rescale (m = -inf gives alpha = 0, l = acc = 0)
    const VF va = hn::Set(df, std::exp2((m - m_new) * kLog2e));
    hn::StoreU(hn::Mul(va, hn::LoadU(df, lv)), df, lv);
    for (int64_t c = 0; c < dp; c += nl)
      hn::StoreU(hn::Mul(va, hn::LoadU(df, acc + c)), df, acc + c);
    m = m_new;
  }
  const VF vsum = scaled
                      ? exponentials(src, src_stride, std::true_type{}, std::false_type{}, m_new)
                      : exponentials(src, src_stride, std::false_type{}, std::false_type{}, m_new);
  hn::StoreU(hn::Add(vsum, hn::LoadU(df, lv)), df, lv);
}

// Scratch memory that keeps its pages between kernel calls: a ring strategy calls the kernel
// once per step with same-sized blocks, and fresh multi-megabyte buffers would cost a page
// fault per 4 KiB every call. One set per thread (a rank of the threads transport is a thread;
// OpenMP workers persist). Contents are undefined: callers fill what they read.
enum class Scratch { k_pack, v_pack, dq_partial, q_pack, do_pack, count };
inline float* scratch(Scratch slot, size_t n) {
  thread_local LineVector<float> buffers[static_cast<int>(Scratch::count)];
  LineVector<float>& b = buffers[static_cast<int>(slot)];
  if (b.size() < n) b.resize(n);
  return b.data();
}

// Note [Blocked dK / dV]: a key row's dK and dV sum the contributions of every query row that
// sees it -- T of them under no mask. Summed in one running fp32 sum, the rounding error grew
// with T (T = 16384: 5-6x torch's error against fp64). The sum is now two-level: the products
// of kDkvBlock consecutive query tiles (of those that see the key tile) accumulate in a plain
// fp32 block partial, exactly as the one running sum did (the same micro-kernel, no extra work
// a tile), and each block partial is added to the running sum by Kahan's compensated sum:
//   y = part - comp;  t = sum + y;  comp = (t - sum) - y;  sum = t
// `comp` holds what the running sum lost (with its sign flipped). The error is that of one
// block's running sum (kDkvBlock x 64 rows) plus a few ulps, whatever the number of blocks;
// the compensated addition costs one pass over the tile per block, not per query tile (an
// earlier form compensated every query tile's product and cost 4 % of the backward; the fp32
// products make that pass in the block's last product itself, gemm_rows_at_compensated). Block
// boundaries count the query tiles a key tile sees, in the task's fixed order, so the order of
// every addition is the same for any thread count (threads = MPI = sim, bit for bit).
// (-ffp-contract=off and no -ffast-math: the compiler may not fold comp to 0.)
constexpr int64_t kDkvBlock = 4;
inline void add_compensated(int64_t n, const float* HWY_RESTRICT part, float* HWY_RESTRICT sum,
                            float* HWY_RESTRICT comp) {
  const DF d;
  const int64_t nl = lanes();
  for (int64_t x = 0; x < n; x += nl) kahan_step(d, hn::LoadU(d, part + x), sum + x, comp + x);
}

// 64 x 64 transpose (for P^T and dS^T in the backward). On AVX-512 in 16 x 16 blocks through
// registers: the scalar loop (one load and one store an element) cost more than the S and dP
// tile products together on the AMX path (dev/08_backward_amx.cc: 2.9 us a tile pair against
// 2.1). A transpose moves values, so the bits are those of the loop.
#if HWY_TARGET == HWY_AVX3 || HWY_TARGET == HWY_AVX3_DL
HWY_INLINE void transpose_16x16(const float* HWY_RESTRICT in, float* HWY_RESTRICT out) {
  __m512 r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_ps(in + i * kTile);
  for (int i = 0; i < 16; i += 2) {  // 2 x 2 blocks of each 128-bit lane
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {  // 4 x 4 blocks of each 128-bit lane
    r[i] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm512_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm512_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int h = 0; h < 16; h += 8)  // then the 128-bit lanes themselves, twice
    for (int i = 0; i < 4; ++i) {
      t[h + i] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0x88);
      t[h + i + 4] = _mm512_shuffle_f32x4(r[h + i], r[h + i + 4], 0xdd);
    }
  for (int i = 0; i < 8; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_f32x4(t[i], t[i + 8], 0xdd);
  }
  for (int i = 0; i < 16; ++i) _mm512_storeu_ps(out + i * kTile, r[i]);
}
inline void transpose_tile(const float* HWY_RESTRICT in, float* HWY_RESTRICT out) {
  for (int64_t i = 0; i < kTile; i += 16)
    for (int64_t j = 0; j < kTile; j += 16)
      transpose_16x16(in + i * kTile + j, out + j * kTile + i);
}
#else
inline void transpose_tile(const float* in, float* out) {
  for (int64_t i = 0; i < kTile; ++i)
    for (int64_t j = 0; j < kTile; ++j) out[j * kTile + i] = in[i * kTile + j];
}
#endif

}  // namespace ctxpar::kernel::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#endif  // per-target include guard
