// Private to the layout layer: the balanced layout's solver (docs/layouts.md, "The balanced
// layout"). Pure functions of the sequence, the mask and P, so every rank computes the same
// assignment from the same input.
#pragma once
#include <cstdint>
#include <span>
#include <vector>

#include "ctxpar/layout.h"

namespace ctxpar {

// Per query chunk of c tokens: its attention work (c * c per (query chunk, key chunk) pair the
// mask leaves any pair visible in, as the kernel computes whole tiles) and the first and last key
// chunk it sees (first > last: none); its visible (query, key) pairs, counted exactly.
struct ChunkCosts {
  int64_t size = 1;
  std::vector<double> work, pairs;
  std::vector<int64_t> first, last;
};
ChunkCosts chunk_costs(const BalanceInput& balance, int64_t tokens, int64_t padded, int64_t c);
// The position / document range of the tokens with these global indices (indices >= tokens are
// padding): mask_rules.h's TileRange, what classify reads.
TileRange tokens_range(const BalanceInput& balance, int64_t tokens, std::span<const int64_t> index);
// The position / document range of each chunk of c tokens (mask_rules.h's TileRange; tokens at
// or past `tokens` are padding), checking the input's lengths.
std::vector<TileRange> chunk_ranges(const BalanceInput& balance, int64_t tokens, int64_t padded,
                                    int64_t c);

// The owner rank of each chunk: every rank gets the same number of chunks, the busiest rank's
// work as low as a greedy solver finds (balance.cc says how: whole pieces of short documents,
// head-tail pairs of long ones as fillers).
std::vector<int32_t> balance_chunks(const ChunkCosts& costs, int ranks);

}  // namespace ctxpar
