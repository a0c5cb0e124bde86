// How global tokens map to ranks. See docs/layouts.md.
//   contiguous: rank r holds tokens [r*Tp/P, (r+1)*Tp/P)
//   zigzag:     2P chunks of Tp/(2P); rank r holds chunks r and 2P-1-r
//   striped:    token t lives on rank t mod P
//   balanced:   chunks of C tokens (C = balanced_chunk(T, P), 64 for long sequences) assigned
//               by a solver that, given the mask, equalises the ranks' attention work (the
//               kernel tiles the mask leaves visible), keeping a document (any run of chunks
//               no query outside it sees into) whole on one rank when that balances and
//               splitting the others head-tail (docs/layouts.md, "The balanced layout").
// Local tokens are kept in increasing global order on every rank.
//
// Any T >= 1 works. The layout cuts a padded sequence of Tp tokens, T rounded up to its
// granule (P, 2P for zigzag, C*P for balanced); the Tp - T padding tokens sit at the end (indices T..Tp-1)
// and carry the position kPaddingPosition, so the kernel neither attends to them nor lets them
// attend to anything (see mask.h). shard() fills their rows with zeros, unshard() drops them:
// padding never reaches a caller's full tensors.
#pragma once
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

enum class LayoutKind { contiguous, zigzag, striped, balanced };
const char* layout_name(LayoutKind k);
LayoutKind parse_layout(const std::string& name);  // throws ctxpar::Error listing valid names
// parse_layout, and "auto": balanced when the mask restricts by documents or slices (its work
// is where the data puts it), else zigzag (balanced under a causal mask, exact bits as before).
LayoutKind choose_layout(const std::string& name, const Mask& mask);

// Tokens per unit the layout cuts the sequence into: P, 2P for zigzag, balanced_chunk(T, P) * P
// for balanced (the only one that depends on T; tokens = 0 means a long sequence). T is padded
// up to a multiple of it (Layout::padded_tokens()); the planner and the bindings use the same
// rule.
int64_t layout_granule(LayoutKind kind, int ranks, int64_t tokens = 0);
// The balanced layout's chunk: 64 tokens (one kernel tile) once T >= 128 P, halved for shorter
// sequences so that every rank holds at least two chunks.
int64_t balanced_chunk(int64_t tokens, int ranks);
// T rounded up to the granule: what Layout(kind, T, P).padded_tokens() holds. Throws
// ctxpar::Error for T < 1, P < 1 or a T too large to round up.
int64_t layout_padded_tokens(LayoutKind kind, int64_t tokens, int ranks);

// What the balanced layout balances: the mask and the tokens' identity over the whole sequence
// (T document ids when the mask uses documents; T positions, empty for 0..T-1).
struct BalanceInput {
  Mask mask;
  std::span<const int32_t> documents;
  std::span<const int64_t> positions;
};

class Layout {
 public:
  // Throws ctxpar::Error for T < 1 or P < 1. `balance` is read by the balanced layout only
  // (without it, the balanced layout balances no mask: every chunk costs the same).
  Layout(LayoutKind kind, int64_t tokens, int ranks, const BalanceInput& balance = {});
  LayoutKind kind() const { return kind_; }
  int64_t tokens() const { return tokens_; }             // T, the real tokens
  int64_t padded_tokens() const { return padded_; }      // Tp >= T, a multiple of the granule
  int64_t padding() const { return padded_ - tokens_; }  // Tp - T (< the granule)
  int ranks() const { return ranks_; }
  int64_t local_tokens() const { return padded_ / ranks_; }  // Tp / P, padding included
  bool is_padding(int64_t index) const { return index >= tokens_; }
  // Global indices (in [0, Tp)) of rank r's local tokens, increasing; those >= T are padding.
  std::vector<int64_t> positions(int rank) const;
  // The global positions of rank r's local tokens as the kernel reads them: `positions[i]` of
  // each real token i (or i itself when `positions` is empty), kPaddingPosition for padding.
  std::vector<int64_t> token_positions(int rank, std::span<const int64_t> positions = {}) const;
  // Owner rank and local index of global token index t in [0, Tp).
  int owner(int64_t t) const;
  int64_t local_index(int64_t t) const;
  // The global index held at each local slot, rank by rank (rank 0's local tokens, then rank
  // 1's, ...: Tp entries), and its inverse (the slot rank * Tl + local index of each global
  // index): what torch's _generate_indices(restore=) gives, to shard position ids and labels.
  std::vector<int64_t> permutation() const;
  std::vector<int64_t> inverse_permutation() const;
  // The attention work (visible kernel tiles of C x C tokens) of each rank's queries under the
  // mask the layout was balanced for (for every layout: the plan and the report compare them).
  std::vector<double> rank_work(const BalanceInput& balance) const;
  // The K/V rows each rank receives from the others under the needed exchange
  // (Exchange::needed): every `tile`-row tile of a peer's local block that some `tile`-row tile
  // of this rank's queries does not skip (classify), whole, padding rows included, as the
  // exchange sends them; a ring moves (P - 1) * local_tokens() rows. The planner's bytes.
  std::vector<int64_t> needed_rows(const BalanceInput& balance, int64_t tile = 64) const;

  // Rank r's share of a tensor whose dim `token_dim` is the global token axis with T entries
  // (e.g. [B, T, H, D] with token_dim 1, or labels [B, T]); contiguous result with
  // local_tokens() entries, zero rows for padding.
  Tensor shard(const TensorView& full, int rank, int token_dim = 1) const;
  // Inverse: shards[r] is rank r's share; writes the full tensor (T entries) in global token
  // order. Padding rows are dropped.
  void unshard(const std::vector<TensorView>& shards, const TensorView& full,
               int token_dim = 1) const;
  // Same for per-token arrays (T entries); padding entries get `pad`.
  template <typename T>
  std::vector<T> shard(const std::vector<T>& full, int rank, T pad = T{}) const {
    CTXPAR_CHECK(static_cast<int64_t>(full.size()) == tokens_, "layout shard: per-token array has ",
                 full.size(), " entries, expected T = ", tokens_);
    std::vector<T> out;
    out.reserve(local_tokens());
    for (int64_t p : positions(rank)) out.push_back(is_padding(p) ? pad : full[p]);
    return out;
  }
  // Inverse for per-token arrays: shards[r] is rank r's share; returns the T entries in
  // global token order.
  template <typename T>
  std::vector<T> unshard(const std::vector<std::vector<T>>& shards) const {
    CTXPAR_CHECK(static_cast<int>(shards.size()) == ranks_, "layout unshard: got ", shards.size(),
                 " shards, expected one per rank (", ranks_, ")");
    std::vector<T> full(tokens_);
    for (int r = 0; r < ranks_; ++r) {
      CTXPAR_CHECK(static_cast<int64_t>(shards[r].size()) == local_tokens(),
                   "layout unshard: shard ", r, " has ", shards[r].size(), " entries, expected ",
                   local_tokens());
      std::vector<int64_t> pos = positions(r);
      for (size_t i = 0; i < pos.size(); ++i)
        if (!is_padding(pos[i])) full[pos[i]] = shards[r][i];
    }
    return full;
  }

 private:
  struct Chunks;  // the balanced layout's assignment
  std::vector<std::pair<int64_t, int64_t>> runs(int rank) const;
  LayoutKind kind_;
  int64_t tokens_, padded_;
  int ranks_;
  std::shared_ptr<const Chunks> chunks_;  // balanced only
};

}  // namespace ctxpar
