// Masks are decided from global token positions, never from a stored matrix.
// Key j is visible to query i iff every enabled rule allows it:
//   causal:        pos_k <= pos_q
//   window (L, R): pos_q - pos_k <= L  and  pos_k - pos_q <= R   (a negative bound = unbounded)
//   documents:     doc_q == doc_k                                 (packed sequences)
// See docs/kernel.md, "Note [Masks from positions]".
#pragma once
#include <cstdint>
#include <limits>
#include <span>
#include <string>

namespace ctxpar {

// The position of a padding token (a Layout pads T up to its granule; see layout.h): whatever
// the mask, no query sees a padding key and a padding query sees nothing (O = 0, LSE = -inf,
// no gradient). No real token may have this position.
inline constexpr int64_t kPaddingPosition = std::numeric_limits<int64_t>::min();

struct Mask {
  bool causal = false;
  int64_t window_left = -1;   // < 0: unbounded
  int64_t window_right = -1;  // < 0: unbounded
  bool documents = false;     // use the tokens' document ids

  static Mask none() { return {}; }
  static Mask causal_mask() { Mask m; m.causal = true; return m; }
  bool any() const { return causal || window_left >= 0 || window_right >= 0 || documents; }
  std::string describe() const;

  bool visible(int64_t pos_q, int64_t pos_k, int32_t doc_q = 0, int32_t doc_k = 0) const {
    if (pos_q == kPaddingPosition || pos_k == kPaddingPosition) return false;
    if (causal && pos_k > pos_q) return false;
    if (window_left >= 0 && pos_q - pos_k > window_left) return false;
    if (window_right >= 0 && pos_k - pos_q > window_right) return false;
    if (documents && doc_q != doc_k) return false;
    return true;
  }
  // True when no (q, k) pair with q positions in [q_lo, q_hi], k positions in [k_lo, k_hi] and
  // document ids in the given ranges can be visible: the whole tile may be skipped.
  bool tile_masked(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int32_t dq_lo = 0,
                   int32_t dq_hi = 0, int32_t dk_lo = 0, int32_t dk_hi = 0) const {
    if (causal && k_lo > q_hi) return true;
    if (window_left >= 0 && q_lo - k_hi > window_left) return true;
    if (window_right >= 0 && k_lo - q_hi > window_right) return true;
    if (documents && (dq_hi < dk_lo || dk_hi < dq_lo)) return true;
    return false;
  }
  // True when every pair of the tile is visible (no per-element masking needed).
  bool tile_full(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int32_t dq_lo = 0,
                 int32_t dq_hi = 0, int32_t dk_lo = 0, int32_t dk_hi = 0) const {
    if (causal && k_hi > q_lo) return false;
    if (window_left >= 0 && q_hi - k_lo > window_left) return false;
    if (window_right >= 0 && k_hi - q_lo > window_right) return false;
    if (documents && !(dq_lo == dq_hi && dk_lo == dk_hi && dq_lo == dk_lo)) return false;
    return true;
  }
};

// Parses "none", "causal", "window:L,R", "causal+window:L,R", "documents",
// "causal+documents" ... (rules joined by '+'). Throws ctxpar::Error naming the bad part.
Mask parse_mask(const std::string& text);

// The global identity of a block's tokens: a position per token (int64) and, when documents are
// used, a document id per token. Both have T entries (shared by every batch row). Positions
// need not be sorted (after a Ulysses all-to-all of a zigzag shard they are not): the kernel
// reads a tile's range as the min and max of its positions, padding (kPaddingPosition) left out.
struct Tokens {
  std::span<const int64_t> positions;
  std::span<const int32_t> documents;  // empty unless the mask uses documents
};

}  // namespace ctxpar
