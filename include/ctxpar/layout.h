// How global tokens map to ranks. See docs/layouts.md.
//   contiguous: rank r holds tokens [r*Tp/P, (r+1)*Tp/P)
//   zigzag:     2P chunks of Tp/(2P); rank r holds chunks r and 2P-1-r
//   striped:    token t lives on rank t mod P
// Local tokens are kept in increasing global order on every rank.
//
// Any T >= 1 works. The layout cuts a padded sequence of Tp tokens, T rounded up to its
// granule (P, or 2P for zigzag); the Tp - T padding tokens sit at the end (indices T..Tp-1)
// and carry the position kPaddingPosition, so the kernel neither attends to them nor lets them
// attend to anything (see mask.h). shard() fills their rows with zeros, unshard() drops them:
// padding never reaches a caller's full tensors.
#pragma once
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

enum class LayoutKind { contiguous, zigzag, striped };
const char* layout_name(LayoutKind k);
LayoutKind parse_layout(const std::string& name);  // throws ctxpar::Error listing valid names

// Tokens per unit the layout cuts the sequence into: P, or 2P for zigzag. T is padded up to a
// multiple of it (Layout::padded_tokens()); the planner and the bindings use the same rule.
int64_t layout_granule(LayoutKind kind, int ranks);
// T rounded up to the granule: what Layout(kind, T, P).padded_tokens() holds. Throws
// ctxpar::Error for T < 1, P < 1 or a T too large to round up.
int64_t layout_padded_tokens(LayoutKind kind, int64_t tokens, int ranks);

class Layout {
 public:
  // Throws ctxpar::Error for T < 1 or P < 1.
  Layout(LayoutKind kind, int64_t tokens, int ranks);
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
  LayoutKind kind_;
  int64_t tokens_, padded_;
  int ranks_;
};

}  // namespace ctxpar
