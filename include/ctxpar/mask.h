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
#include <vector>

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

  // The keys a query at pos_q may see by position lie in [lo, hi] (documents aside). The
  // bounds saturate at the ends of int64, so every rule below is exact over the whole range
  // (pos_q - L would overflow near INT64_MIN, and did: issue 9, positions near -2^62).
  struct KeyRange {
    int64_t lo, hi;
  };
  KeyRange key_range(int64_t pos_q) const {
    KeyRange r{std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
    if (window_left >= 0) r.lo = minus(pos_q, window_left);
    if (window_right >= 0) r.hi = plus(pos_q, window_right);
    if (causal && pos_q < r.hi) r.hi = pos_q;
    return r;
  }
  bool visible(int64_t pos_q, int64_t pos_k, int32_t doc_q = 0, int32_t doc_k = 0) const {
    if (pos_q == kPaddingPosition || pos_k == kPaddingPosition) return false;
    const KeyRange r = key_range(pos_q);
    return pos_k >= r.lo && pos_k <= r.hi && (!documents || doc_q == doc_k);
  }
  // True when no (q, k) pair with q positions in [q_lo, q_hi], k positions in [k_lo, k_hi] and
  // document ids in the given ranges can be visible: the whole tile may be skipped. Key ranges
  // grow with pos_q, so the tile's extreme queries bound them.
  bool tile_masked(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int32_t dq_lo = 0,
                   int32_t dq_hi = 0, int32_t dk_lo = 0, int32_t dk_hi = 0) const {
    if (k_hi < key_range(q_lo).lo || k_lo > key_range(q_hi).hi) return true;
    if (documents && (dq_hi < dk_lo || dk_hi < dq_lo)) return true;
    return false;
  }
  // True when every pair of the tile is visible (no per-element masking needed).
  bool tile_full(int64_t q_lo, int64_t q_hi, int64_t k_lo, int64_t k_hi, int32_t dq_lo = 0,
                 int32_t dq_hi = 0, int32_t dk_lo = 0, int32_t dk_hi = 0) const {
    if (k_lo < key_range(q_hi).lo || k_hi > key_range(q_lo).hi) return false;
    if (documents && !(dq_lo == dq_hi && dk_lo == dk_hi && dq_lo == dk_lo)) return false;
    return true;
  }

 private:
  // a - b and a + b for b >= 0, saturated at the ends of int64.
  static int64_t minus(int64_t a, int64_t b) {
    return a < std::numeric_limits<int64_t>::min() + b ? std::numeric_limits<int64_t>::min() : a - b;
  }
  static int64_t plus(int64_t a, int64_t b) {
    return a > std::numeric_limits<int64_t>::max() - b ? std::numeric_limits<int64_t>::max() : a + b;
  }
};

// Parses "none", "causal", "window:L,R", "causal+window:L,R", "documents",
// "causal+documents:300,724" ... (rules joined by '+', each at most once; no spaces; numbers
// whole and within int64). Throws ctxpar::Error naming the bad part and the grammar.
Mask parse_mask(const std::string& text);
// The lengths of the "documents:LEN,LEN,..." rule of `text` (empty when its documents rule has
// none, or it has no documents rule); checked as parse_mask checks the whole text.
std::vector<int64_t> parse_document_lengths(const std::string& text);

// The global identity of a block's tokens: a position per token (int64) and, when documents are
// used, a document id per token. Both have T entries (shared by every batch row). Positions
// need not be sorted (after a Ulysses all-to-all of a zigzag shard they are not): the kernel
// reads a tile's range as the min and max of its positions, padding (kPaddingPosition) left out.
struct Tokens {
  std::span<const int64_t> positions;
  std::span<const int32_t> documents;  // empty unless the mask uses documents
};

}  // namespace ctxpar
