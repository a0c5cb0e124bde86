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

#include "ctxpar/mask_rules.h"  // the rules themselves, shared with the GPU's fallback kernel

namespace ctxpar {

// A mask: MaskRules (visible, tile_masked, tile_full, kPaddingPosition) and its names.
struct Mask : MaskRules {
  static Mask none() { return {}; }
  static Mask causal_mask() {
    Mask m;
    m.causal = true;
    return m;
  }
  bool any() const { return causal || window_left >= 0 || window_right >= 0 || documents; }
  std::string describe() const;

  // The keys a query at pos_q may see by position lie in [lo, hi] (documents aside), saturated
  // at the ends of int64.
  struct KeyRange {
    int64_t lo, hi;
  };
  KeyRange key_range(int64_t pos_q) const { return {key_lo(pos_q), key_hi(pos_q)}; }
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
