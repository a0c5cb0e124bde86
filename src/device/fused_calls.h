// How one (query block, K/V block) pair of a strategy maps onto the calls of a fused attention
// library (cuDNN's SDPA), for the CUDA device. A pure host function, tested exhaustively on
// the CPU (tests/fused): every layout x rank count x mask, each call run through the CPU
// kernel, every visible (q, k) pair covered exactly once.
//
// A fused call cannot read our token positions: it sees rows 0..nq-1 and keys 0..nk-1 of the
// tensors it is given and masks by their indices alone (no mask, a causal diagonal aligned top
// left or bottom right, a band of diagonals, ragged sequences). ctxpar masks by positions, and
// a block's positions are not its indices: zigzag holds two chunks, striped steps by P, packed
// documents cut the sequence, padding ends it. The bridge: cut each block into *runs*, tokens
// whose positions step by one constant stride inside one document. Between a query run
// (positions bq + s*i) and a key run (bk + s*j) every rule of mask.h is a bound on i - j:
//   d = q_pos - k_pos = (bq - bk) + s*(i - j),  causal: d >= 0,  window (L, R): -R <= d <= L
// so the visible pairs of two runs are a band of diagonals, cut to the rows and keys that see
// something: exactly one call. (Runs of different strides fall back to single tokens.)
//
// Invariants the test proves: the calls of a block cover each visible (q, k) pair once and no
// other pair; no call holds a row with no visible key (cuDNN leaves such rows undefined);
// padding tokens appear in no call (their rows stay O = 0, LSE = -inf).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/mask.h"

namespace ctxpar::fused {

// Tokens [begin, end) of a block whose positions are first + stride * (t - begin), in one
// document (stride >= 1; a run of one token has stride 0 and pairs with any stride).
struct Run {
  int64_t begin = 0, end = 0;
  int64_t first = 0, stride = 0;
  int32_t document = 0;
  int64_t size() const { return end - begin; }
};
// The maximal runs of a block, padding tokens (kPaddingPosition) left out. `documents`: cut at
// every change of document id (tokens.documents must then hold one id per token).
std::vector<Run> split_runs(const Tokens& tokens, bool documents);

// One fused call: rows [q_begin, q_end) of the query block against keys [k_begin, k_end) of
// the K/V block. On call-local indices i' = i - q_begin, j' = j - k_begin, a pair is visible
// when
//   j' - i' <= upper   (if has_upper: keys right of a diagonal are hidden; causal is upper 0)
//   i' - j' <= lower   (if has_lower: keys further left than a band are hidden)
// (upper, lower >= 0 always). Every row of the call sees at least one key.
struct Call {
  int64_t q_begin = 0, q_end = 0, k_begin = 0, k_end = 0;
  bool has_upper = false, has_lower = false;
  int64_t upper = 0, lower = 0;
  int64_t rows() const { return q_end - q_begin; }
  int64_t keys() const { return k_end - k_begin; }
  bool visible(int64_t i, int64_t j) const {  // call-local indices
    return (!has_upper || j - i <= upper) && (!has_lower || i - j <= lower);
  }
  // How cuDNN expresses it: "none", "causal top-left", "causal bottom-right" or
  // "band(upper=U, lower=L)" (a diagonal band: right bound U, left bound L from the top-left
  // diagonal).
  std::string describe() const;
  // The mask the CPU kernel applies to the call when its tokens carry positions 0..rows-1 and
  // 0..keys-1: a window (lower, upper), so the CPU runs exactly what the fused call would.
  Mask local_mask() const;
};

// The calls of one block pair, in a fixed order (query runs outer, key runs inner).
std::vector<Call> decompose(const Tokens& q_tokens, const Tokens& k_tokens, const Mask& mask);

// Groups calls into batches one ragged (THD) fused call can run: the same mask form and no
// query row in two calls of a batch (a batch writes its rows' O and LSE once). Returns the
// indices into `calls`, batch by batch, in order.
std::vector<std::vector<size_t>> batch_calls(const std::vector<Call>& calls);

}  // namespace ctxpar::fused
