// The mask's rules and the tile classification, written once for the host and the GPU: mask.h's
// Mask and the CPU kernel (src/kernel/problem.h) use them, and so does the cuda device's
// fallback kernel (src/cuda/tile_math.cuh, compiled by nvcc for the device and by the host
// compiler for its host runs). Plain data and integer arithmetic only: no standard library
// beyond <stdint.h>, nothing a device function cannot call. See docs/kernel.md, "Note [Masks
// from positions]".
#pragma once
#include <stdint.h>

#if defined(__CUDACC__)
#define CTXPAR_HD __host__ __device__ inline
#else
#define CTXPAR_HD inline
#endif

namespace ctxpar {

inline constexpr int64_t kInt64Min = -9223372036854775807LL - 1;
inline constexpr int64_t kInt64Max = 9223372036854775807LL;

// The position of a padding token (a Layout pads T up to its granule; see layout.h): whatever
// the mask, no query sees a padding key and a padding query sees nothing (O = 0, LSE = -inf,
// no gradient). No real token may have this position.
inline constexpr int64_t kPaddingPosition = kInt64Min;

// One slice of a general mask (MagiAttention's AttnSlice): queries at positions [q_lo, q_hi) see
// keys at positions [k_lo, k_hi), all of them (full) or causally aligned at the bottom-right
// corner of the slice, as flash-attention aligns unequal lengths (causal): query q sees key k iff
// k - k_hi <= q - q_hi. A mask of slices is their union: a key is visible iff some slice shows
// it. Documents, windows, prefix trees, sinks and block-sparse patterns are all unions of slices.
// Bounds: 0 <= lo < hi <= kMaxSlicePosition (parse_mask checks), so no arithmetic here overflows.
struct MaskSlice {
  int64_t q_lo = 0, q_hi = 0, k_lo = 0, k_hi = 0;
  int32_t causal = 0;  // 1: bottom-right causal, 0: full
  int32_t unused = 0;
  // The last key position query q (inside [q_lo, q_hi)) sees; < k_lo when it sees none.
  CTXPAR_HD int64_t key_hi(int64_t q) const {
    const int64_t last = k_hi - 1;
    if (!causal) return last;
    const int64_t diag = q + (k_hi - q_hi);
    return diag < last ? diag : last;
  }
  CTXPAR_HD bool shows(int64_t q, int64_t k) const {
    return q >= q_lo && q < q_hi && k >= k_lo && k <= key_hi(q);
  }
  // Some pair of the rectangle [qa, qb] x [ka, kb] (inclusive) is shown.
  CTXPAR_HD bool touches(int64_t qa, int64_t qb, int64_t ka, int64_t kb) const {
    const int64_t ql = qa > q_lo ? qa : q_lo, qh = qb < q_hi - 1 ? qb : q_hi - 1;
    if (ql > qh) return false;
    const int64_t kl = ka > k_lo ? ka : k_lo, top = key_hi(qh), kh = kb < top ? kb : top;
    return kl <= kh;
  }
  // Every pair of the rectangle is shown.
  CTXPAR_HD bool covers(int64_t qa, int64_t qb, int64_t ka, int64_t kb) const {
    return qa >= q_lo && qb < q_hi && ka >= k_lo && kb <= key_hi(qa);
  }
};
inline constexpr int64_t kMaxSlicePosition = int64_t{1} << 62;

// Key j is visible to query i iff every enabled rule allows it (mask.h).
struct MaskRules {
  bool causal = false;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  bool documents = false;     // use the tokens' document ids
  // A slice mask (MaskSlice): when `sliced`, a pair must also be shown by one of the
  // `slice_count` slices at `slices` (memory the owner keeps: Mask holds it on the host).
  bool sliced = false;
  int32_t slice_count = 0;
  const MaskSlice* slices = nullptr;

  // a - b and a + b for b >= 0, saturated at the ends of int64, so that every rule below is
  // exact over the whole range of positions (pos_q - L would overflow near INT64_MIN).
  CTXPAR_HD static int64_t minus(int64_t a, int64_t b) {
    return a < kInt64Min + b ? kInt64Min : a - b;
  }
  CTXPAR_HD static int64_t plus(int64_t a, int64_t b) {
    return a > kInt64Max - b ? kInt64Max : a + b;
  }
  // The keys a query at pos_q may see by position lie in [key_lo, key_hi] (documents aside).
  CTXPAR_HD int64_t key_lo(int64_t pos_q) const {
    return window_left >= 0 ? minus(pos_q, window_left) : kInt64Min;
  }
  CTXPAR_HD int64_t key_hi(int64_t pos_q) const {
    int64_t hi = window_right >= 0 ? plus(pos_q, window_right) : kInt64Max;
    if (causal && pos_q < hi) hi = pos_q;
    return hi;
  }
  CTXPAR_HD bool visible(int64_t pos_q, int64_t pos_k, int32_t doc_q = 0, int32_t doc_k = 0) const {
    if (pos_q == kPaddingPosition || pos_k == kPaddingPosition) return false;
    return pos_k >= key_lo(pos_q) && pos_k <= key_hi(pos_q) && (!documents || doc_q == doc_k) &&
           (!sliced || sliced_shows(pos_q, pos_k));
  }
  CTXPAR_HD bool sliced_shows(int64_t pos_q, int64_t pos_k) const {
    for (int32_t i = 0; i < slice_count; ++i)
      if (slices[i].shows(pos_q, pos_k)) return true;
    return false;
  }
  // True when no (q, k) pair with q positions in [q_lo, q_hi], k positions in [k_lo, k_hi] and
  // document ids in the given ranges can be visible: the whole tile may be skipped. Key ranges
  // grow with pos_q, so the tile's extreme queries bound them.
  CTXPAR_HD bool tile_masked(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi,
                             int32_t dq_lo = 0, int32_t dq_hi = 0, int32_t dk_lo = 0,
                             int32_t dk_hi = 0) const {
    if (k_hi < key_lo(q_lo) || k_lo > key_hi(q_hi)) return true;
    if (documents && (dq_hi < dk_lo || dk_hi < dq_lo)) return true;
    if (!sliced) return false;
    for (int32_t i = 0; i < slice_count; ++i)
      if (slices[i].touches(q_lo, q_hi, k_lo, k_hi)) return false;
    return true;
  }
  // True when every pair of the tile is visible (no per-element masking needed).
  CTXPAR_HD bool tile_full(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi,
                           int32_t dq_lo = 0, int32_t dq_hi = 0, int32_t dk_lo = 0,
                           int32_t dk_hi = 0) const {
    if (k_lo < key_lo(q_hi) || k_hi > key_hi(q_lo)) return false;
    if (documents && !(dq_lo == dq_hi && dk_lo == dk_hi && dq_lo == dk_lo)) return false;
    if (!sliced) return true;
    for (int32_t i = 0; i < slice_count; ++i)
      if (slices[i].covers(q_lo, q_hi, k_lo, k_hi)) return true;
    return false;  // several slices may cover it together: partial is still exact
  }
};

// The position / document range of one tile's real tokens (padding left out).
struct TileRange {
  enum Padding : int32_t { none = 0, some = 1, all = 2 };  // padding tokens in the tile
  int64_t pos_lo = 0, pos_hi = 0;
  int32_t doc_lo = 0, doc_hi = 0;
  int32_t padding = none;  // all: the ranges are never read
};

// What a (query tile, key tile) pair needs: nothing, every pair, or a per-element mask.
enum class TileKind : int { skip = 0, full = 1, partial = 2 };
CTXPAR_HD TileKind classify(const MaskRules& m, const TileRange& q, const TileRange& k) {
  if (q.padding == TileRange::all || k.padding == TileRange::all) return TileKind::skip;
  const int32_t dql = m.documents ? q.doc_lo : 0, dqh = m.documents ? q.doc_hi : 0;
  const int32_t dkl = m.documents ? k.doc_lo : 0, dkh = m.documents ? k.doc_hi : 0;
  if (m.tile_masked(q.pos_lo, q.pos_hi, k.pos_lo, k.pos_hi, dql, dqh, dkl, dkh))
    return TileKind::skip;
  const bool padded = q.padding != TileRange::none || k.padding != TileRange::none;
  if (!padded && m.tile_full(q.pos_lo, q.pos_hi, k.pos_lo, k.pos_hi, dql, dqh, dkl, dkh))
    return TileKind::full;
  return TileKind::partial;
}

}  // namespace ctxpar
