// Masks are decided from global token positions, never from a stored matrix.
// Key j is visible to query i iff every enabled rule allows it:
//   causal:        pos_k <= pos_q
//   window (L, R): pos_q - pos_k <= L  and  pos_k - pos_q <= R   (a negative bound = unbounded)
//   documents:     doc_q == doc_k                                 (packed sequences)
//   slices:        some MaskSlice of a list shows (pos_q, pos_k)   (mask_rules.h: any block mask)
// See docs/kernel.md, "Note [Masks from positions]".
#pragma once
#include <cstdint>
#include <limits>
#include <memory>
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
  bool any() const {
    return causal || window_left >= 0 || window_right >= 0 || documents || sliced;
  }
  // "causal+window:L,R+documents+slices:N@HASH": the slices by count and an FNV-1a hash of their
  // bounds, so that two ranks whose lists differ describe (and agree) differently.
  std::string describe() const;

  // Makes this a slice mask over `slices` (kept here, shared by copies of this Mask). Throws
  // ctxpar::Error naming the first slice outside 0 <= lo < hi <= kMaxSlicePosition.
  void set_slices(std::vector<MaskSlice> slices);
  std::span<const MaskSlice> slice_list() const {
    return {slices, static_cast<size_t>(sliced ? slice_count : 0)};
  }

  // The keys a query at pos_q may see by position lie in [lo, hi] (documents aside), saturated
  // at the ends of int64.
  struct KeyRange {
    int64_t lo, hi;
  };
  KeyRange key_range(int64_t pos_q) const { return {key_lo(pos_q), key_hi(pos_q)}; }

 private:
  std::shared_ptr<const std::vector<MaskSlice>> slice_store_;
};

// Parses "none", "causal", "window:L,R", "causal+window:L,R", "documents",
// "causal+documents:300,724", "prefix-tree:PROMPT,R1,R2,...", "slices:FILE.json" ... (rules
// joined by '+', each at most once; no spaces; numbers whole and within int64). Throws
// ctxpar::Error naming the bad part and the grammar.
//   prefix-tree:P,R1,...  tokens [0, P) a prompt (causal), then responses of R1, R2, ... tokens,
//                         each seeing the whole prompt and itself causally (RL, best-of-n)
//   slices:FILE.json      [{"q": [start, end), "k": [start, end), "type": "full" | "causal"}, ...]
//   slices:[...]          the same list inline (Python's mask= list of slices)
Mask parse_mask(const std::string& text);
// The slices of a prefix tree (prompt tokens, then each response's): prompt x prompt causal;
// per response, response x prompt full and response x response causal.
std::vector<MaskSlice> prefix_tree_slices(int64_t prompt, const std::vector<int64_t>& responses);
// Parses the JSON text of a slice list (the grammar above); `subject` names it in errors.
std::vector<MaskSlice> parse_slices_json(const std::string& text, const std::string& subject);
// The tokens of the mask's prefix tree (the sum of its parts; 0 without one): the job checks
// it against T (documents:LEN,... are checked by the job from parse_document_lengths).
int64_t mask_length_total(const std::string& text);
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
