// Token -> rank maps. See docs/layouts.md.
#include "ctxpar/layout.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "ctxpar/error.h"

namespace ctxpar {

const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped:
      return "striped";
  }
  return "?";
}

LayoutKind parse_layout(const std::string& name) {
  if (name == "contiguous") return LayoutKind::contiguous;
  if (name == "zigzag") return LayoutKind::zigzag;
  if (name == "striped") return LayoutKind::striped;
  throw Error("unknown layout '" + name + "': use contiguous, zigzag or striped");
}

int64_t layout_granule(LayoutKind kind, int ranks) {
  return kind == LayoutKind::zigzag ? 2 * int64_t(ranks) : int64_t(ranks);
}

int64_t layout_padded_tokens(LayoutKind kind, int64_t tokens, int ranks) {
  CTXPAR_CHECK(ranks >= 1, "layout: ranks must be >= 1, got ", ranks);
  CTXPAR_CHECK(tokens >= 1, "layout: the sequence needs at least one token, got T = ", tokens);
  const int64_t g = layout_granule(kind, ranks);
  CTXPAR_CHECK(tokens <= std::numeric_limits<int64_t>::max() - g, "layout: T = ", tokens,
               " is too large");
  return (tokens + g - 1) / g * g;
}

namespace {

// The runs [global_begin, global_end) that rank r holds, in increasing order. Every layout is
// a few runs (contiguous 1, zigzag 2) or many runs of one token (striped).
std::vector<std::pair<int64_t, int64_t>> runs(LayoutKind kind, int64_t tokens, int ranks, int r) {
  const int64_t tl = tokens / ranks;
  std::vector<std::pair<int64_t, int64_t>> out;
  switch (kind) {
    case LayoutKind::contiguous:
      out.push_back({r * tl, (r + 1) * tl});
      break;
    case LayoutKind::zigzag: {
      const int64_t c = tokens / (2 * int64_t(ranks));
      const int64_t late = 2 * int64_t(ranks) - 1 - r;
      out.push_back({r * c, (r + 1) * c});
      out.push_back({late * c, (late + 1) * c});
      break;
    }
    case LayoutKind::striped:
      out.reserve(tl);
      for (int64_t i = 0; i < tl; ++i) out.push_back({r + i * ranks, r + i * ranks + 1});
      break;
  }
  return out;
}

void check_token_dim(const TensorView& t, int token_dim, int64_t expected, const char* what) {
  CTXPAR_CHECK(token_dim >= 0 && token_dim < t.ndim(), what, ": token_dim ", token_dim,
               " out of range for a tensor of shape ", shape_str(t.shape()));
  CTXPAR_CHECK(t.dim(token_dim) == expected, what, ": dim ", token_dim, " of shape ",
               shape_str(t.shape()), " must be ", expected, " tokens");
}

}  // namespace

Layout::Layout(LayoutKind kind, int64_t tokens, int ranks)
    : kind_(kind), tokens_(tokens), ranks_(ranks) {
  padded_ = layout_padded_tokens(kind, tokens, ranks);
}

std::vector<int64_t> Layout::positions(int rank) const {
  CTXPAR_CHECK(rank >= 0 && rank < ranks_, "layout: rank ", rank, " out of range [0, ", ranks_,
               ")");
  std::vector<int64_t> out;
  out.reserve(local_tokens());
  for (auto [b, e] : runs(kind_, padded_, ranks_, rank))
    for (int64_t t = b; t < e; ++t) out.push_back(t);
  return out;
}

std::vector<int64_t> Layout::token_positions(int rank, std::span<const int64_t> given) const {
  CTXPAR_CHECK(given.empty() || static_cast<int64_t>(given.size()) == tokens_,
               "layout: ", given.size(), " positions for T = ", tokens_, " tokens");
  std::vector<int64_t> out = positions(rank);
  for (int64_t& t : out)
    t = is_padding(t) ? kPaddingPosition : given.empty() ? t : given[static_cast<size_t>(t)];
  return out;
}

int Layout::owner(int64_t t) const {
  CTXPAR_CHECK(t >= 0 && t < padded_, "layout: token ", t, " out of range [0, ", padded_, ")");
  switch (kind_) {
    case LayoutKind::contiguous:
      return static_cast<int>(t / local_tokens());
    case LayoutKind::zigzag: {
      const int64_t chunk = t / (padded_ / (2 * int64_t(ranks_)));
      return static_cast<int>(chunk < ranks_ ? chunk : 2 * int64_t(ranks_) - 1 - chunk);
    }
    case LayoutKind::striped:
      return static_cast<int>(t % ranks_);
  }
  return 0;
}

int64_t Layout::local_index(int64_t t) const {
  const int r = owner(t);
  switch (kind_) {
    case LayoutKind::contiguous:
      return t - r * local_tokens();
    case LayoutKind::zigzag: {
      const int64_t c = padded_ / (2 * int64_t(ranks_));
      return t / c < ranks_ ? t - r * c : c + t - (2 * int64_t(ranks_) - 1 - r) * c;
    }
    case LayoutKind::striped:
      return t / ranks_;
  }
  return 0;
}

// The part of run [b, e) that holds real tokens: [b, min(e, T)).
Tensor Layout::shard(const TensorView& full, int rank, int token_dim) const {
  check_token_dim(full, token_dim, tokens_, "layout shard: full");
  CTXPAR_CHECK(rank >= 0 && rank < ranks_, "layout shard: rank ", rank, " out of range [0, ",
               ranks_, ")");
  Shape shape = full.shape();
  shape[token_dim] = local_tokens();
  Tensor out(full.dtype(), shape);  // zero-filled: padding rows stay zero
  int64_t i = 0;
  for (auto [b, e] : runs(kind_, padded_, ranks_, rank)) {
    const int64_t real_end = std::min(e, tokens_);
    if (real_end > b)
      copy_into(full.slice(token_dim, b, real_end),
                out.view().slice(token_dim, i, i + (real_end - b)));
    i += e - b;
  }
  return out;
}

void Layout::unshard(const std::vector<TensorView>& shards, const TensorView& full,
                     int token_dim) const {
  check_token_dim(full, token_dim, tokens_, "layout unshard: full");
  CTXPAR_CHECK(static_cast<int>(shards.size()) == ranks_, "layout unshard: got ", shards.size(),
               " shards, expected one per rank (", ranks_, ")");
  for (int r = 0; r < ranks_; ++r) {
    Shape want = full.shape();
    want[token_dim] = local_tokens();
    CTXPAR_CHECK(shards[r].shape() == want, "layout unshard: shard ", r, " has shape ",
                 shape_str(shards[r].shape()), ", expected ", shape_str(want));
    int64_t i = 0;
    for (auto [b, e] : runs(kind_, padded_, ranks_, r)) {
      const int64_t real_end = std::min(e, tokens_);
      if (real_end > b)
        copy_into(shards[r].slice(token_dim, i, i + (real_end - b)),
                  full.slice(token_dim, b, real_end));
      i += e - b;
    }
  }
}

}  // namespace ctxpar
