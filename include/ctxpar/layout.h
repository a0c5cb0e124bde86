// How global tokens map to ranks. See docs/layouts.md.
//   contiguous: rank r holds tokens [r*T/P, (r+1)*T/P)                  (T % P == 0)
//   zigzag:     2P chunks of T/(2P); rank r holds chunks r and 2P-1-r   (T % 2P == 0)
//   striped:    token t lives on rank t mod P                           (T % P == 0)
// Local tokens are kept in increasing global order on every rank.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/error.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

enum class LayoutKind { contiguous, zigzag, striped };
const char* layout_name(LayoutKind k);
LayoutKind parse_layout(const std::string& name);  // throws ctxpar::Error listing valid names

class Layout {
 public:
  // Throws ctxpar::Error naming the rule when T does not divide (e.g. "zigzag needs
  // T % 2P == 0: T = 1000, P = 3; use T = 996 or 1002").
  Layout(LayoutKind kind, int64_t tokens, int ranks);
  LayoutKind kind() const { return kind_; }
  int64_t tokens() const { return tokens_; }
  int ranks() const { return ranks_; }
  int64_t local_tokens() const { return tokens_ / ranks_; }
  // Global positions of rank r's local tokens, increasing.
  std::vector<int64_t> positions(int rank) const;
  // Owner rank and local index of global token t.
  int owner(int64_t t) const;
  int64_t local_index(int64_t t) const;

  // Rank r's share of a tensor whose dim `token_dim` is the global token axis (e.g. [B, T, H,
  // D] with token_dim 1, or labels [B, T]); contiguous result.
  Tensor shard(const TensorView& full, int rank, int token_dim = 1) const;
  // Inverse: shards[r] is rank r's share; writes the full tensor in global token order.
  void unshard(const std::vector<TensorView>& shards, const TensorView& full,
               int token_dim = 1) const;
  // Same for per-token integer arrays.
  template <typename T>
  std::vector<T> shard(const std::vector<T>& full, int rank) const {
    CTXPAR_CHECK(static_cast<int64_t>(full.size()) == tokens_, "layout shard: per-token array has ",
                 full.size(), " entries, expected T = ", tokens_);
    std::vector<T> out;
    out.reserve(local_tokens());
    for (int64_t p : positions(rank)) out.push_back(full[p]);
    return out;
  }
  // Inverse for per-token arrays: shards[r] is rank r's share; returns the T entries in
  // global token order.
  template <typename T>
  std::vector<T> unshard(const std::vector<std::vector<T>>& shards) const {
    CTXPAR_CHECK(static_cast<int>(shards.size()) == ranks_, "layout unshard: got ",
                 shards.size(), " shards, expected one per rank (", ranks_, ")");
    std::vector<T> full(tokens_);
    for (int r = 0; r < ranks_; ++r) {
      CTXPAR_CHECK(static_cast<int64_t>(shards[r].size()) == local_tokens(),
                   "layout unshard: shard ", r, " has ", shards[r].size(), " entries, expected ",
                   local_tokens());
      std::vector<int64_t> pos = positions(r);
      for (size_t i = 0; i < pos.size(); ++i) full[pos[i]] = shards[r][i];
    }
    return full;
  }

 private:
  LayoutKind kind_;
  int64_t tokens_;
  int ranks_;
};

}  // namespace ctxpar
