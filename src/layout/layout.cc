// Token -> rank maps. See docs/layouts.md.
#include "ctxpar/layout.h"

#include <algorithm>
#include <limits>
#include <utility>

#include "ctxpar/error.h"
#include "ctxpar/kernel.h"  // kKernelTile: the balanced layout's chunk
#include "layout/balance.h"

namespace ctxpar {

const char* layout_name(LayoutKind k) {
  switch (k) {
    case LayoutKind::contiguous:
      return "contiguous";
    case LayoutKind::zigzag:
      return "zigzag";
    case LayoutKind::striped:
      return "striped";
    case LayoutKind::balanced:
      return "balanced";
  }
  return "?";
}

LayoutKind parse_layout(const std::string& name) {
  if (name == "contiguous") return LayoutKind::contiguous;
  if (name == "zigzag") return LayoutKind::zigzag;
  if (name == "striped") return LayoutKind::striped;
  if (name == "balanced") return LayoutKind::balanced;
  throw Error("unknown layout '" + name +
              "': use contiguous, zigzag, striped or balanced (or auto, "
              "where the command knows the mask)");
}

LayoutKind choose_layout(const std::string& name, const Mask& mask) {
  if (name != "auto") return parse_layout(name);
  return mask.documents || mask.sliced ? LayoutKind::balanced : LayoutKind::zigzag;
}

int64_t balanced_chunk(int64_t tokens, int ranks) {
  int64_t c = kKernelTile;
  while (c > 1 && tokens > 0 && tokens < 2 * c * ranks) c /= 2;
  return c;
}

int64_t layout_granule(LayoutKind kind, int ranks, int64_t tokens) {
  if (kind == LayoutKind::balanced) return balanced_chunk(tokens, ranks) * ranks;
  return kind == LayoutKind::zigzag ? 2 * int64_t(ranks) : int64_t(ranks);
}

int64_t layout_padded_tokens(LayoutKind kind, int64_t tokens, int ranks) {
  CTXPAR_CHECK(ranks >= 1, "layout: ranks must be >= 1, got ", ranks);
  CTXPAR_CHECK(tokens >= 1, "layout: the sequence needs at least one token, got T = ", tokens);
  const int64_t g = layout_granule(kind, ranks, tokens);
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
    case LayoutKind::balanced:
      break;  // Layout::runs: from the assignment
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

// The balanced layout's assignment: chunk i of `size` tokens lives on rank owner[i] at local
// offset local[i]; by_rank[r] lists rank r's chunks in increasing order.
struct Layout::Chunks {
  int64_t size = 1;
  std::vector<int32_t> owner;
  std::vector<int64_t> local;
  std::vector<std::vector<int64_t>> by_rank;
};

Layout::Layout(LayoutKind kind, int64_t tokens, int ranks, const BalanceInput& balance)
    : kind_(kind), tokens_(tokens), ranks_(ranks) {
  padded_ = layout_padded_tokens(kind, tokens, ranks);
  if (kind != LayoutKind::balanced) return;
  const int64_t c = balanced_chunk(tokens, ranks);
  const std::vector<int32_t> owner =
      balance_chunks(chunk_costs(balance, tokens, padded_, c), ranks);
  auto chunks = std::make_shared<Chunks>();
  chunks->size = c;
  chunks->owner = owner;
  chunks->local.resize(owner.size());
  chunks->by_rank.resize(size_t(ranks));
  for (size_t i = 0; i < owner.size(); ++i) {
    std::vector<int64_t>& mine = chunks->by_rank[size_t(owner[i])];
    chunks->local[i] = int64_t(mine.size()) * c;
    mine.push_back(int64_t(i));
  }
  chunks_ = std::move(chunks);
}

std::vector<std::pair<int64_t, int64_t>> Layout::runs(int rank) const {
  if (kind_ != LayoutKind::balanced) return ::ctxpar::runs(kind_, padded_, ranks_, rank);
  std::vector<std::pair<int64_t, int64_t>> out;
  const int64_t c = chunks_->size;
  for (int64_t i : chunks_->by_rank[size_t(rank)]) {
    if (!out.empty() && out.back().second == i * c)
      out.back().second += c;  // adjacent chunks: one run
    else
      out.push_back({i * c, (i + 1) * c});
  }
  return out;
}

std::vector<int64_t> Layout::positions(int rank) const {
  CTXPAR_CHECK(rank >= 0 && rank < ranks_, "layout: rank ", rank, " out of range [0, ", ranks_,
               ")");
  std::vector<int64_t> out;
  out.reserve(local_tokens());
  for (auto [b, e] : runs(rank))
    for (int64_t t = b; t < e; ++t) out.push_back(t);
  return out;
}

std::vector<int64_t> Layout::permutation() const {
  std::vector<int64_t> out;
  out.reserve(size_t(padded_));
  for (int r = 0; r < ranks_; ++r)
    for (int64_t t : positions(r)) out.push_back(t);
  return out;
}

std::vector<int64_t> Layout::inverse_permutation() const {
  const std::vector<int64_t> perm = permutation();
  std::vector<int64_t> inv(perm.size());
  for (size_t slot = 0; slot < perm.size(); ++slot) inv[size_t(perm[slot])] = int64_t(slot);
  return inv;
}

std::vector<double> Layout::rank_work(const BalanceInput& balance) const {
  const int64_t c = kind_ == LayoutKind::balanced ? chunks_->size : balanced_chunk(tokens_, ranks_);
  // Work is counted on chunks of c tokens; a layout whose runs cut inside a chunk (striped,
  // or zigzag at a short T) has its work counted per token of each chunk, pro rata.
  const std::vector<double> work = chunk_costs(balance, tokens_, padded_, c).work;
  std::vector<double> out(size_t(ranks_), 0.0);
  for (int r = 0; r < ranks_; ++r)
    for (auto [b, e] : runs(r))
      for (int64_t t = b; t < e;) {
        const int64_t i = t / c, end = std::min(e, (i + 1) * c);
        out[size_t(r)] += work[size_t(i)] * double(end - t) / double(c);
        t = end;
      }
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

std::vector<int64_t> Layout::needed_rows(const BalanceInput& balance, int64_t tile) const {
  CTXPAR_CHECK(tile >= 1, "layout: needed_rows tile ", tile, " < 1");
  (void)chunk_ranges(balance, tokens_, padded_, padded_);  // checks the input's lengths
  const int64_t local = local_tokens(), nt = (local + tile - 1) / tile;
  const size_t p = size_t(ranks_);
  std::vector<TileRange> tiles(p * size_t(nt));  // rank r's local tile i at r * nt + i
  for (int r = 0; r < ranks_; ++r) {
    const std::vector<int64_t> index = positions(r);
    for (int64_t i = 0; i < nt; ++i) {
      const int64_t b = i * tile, e = std::min(local, b + tile);
      tiles[size_t(r) * size_t(nt) + size_t(i)] =
          tokens_range(balance, tokens_, std::span(index).subspan(size_t(b), size_t(e - b)));
    }
  }
  std::vector<int64_t> out(p, 0);
  for (size_t r = 0; r < p; ++r)
    for (size_t s = 0; s < p; ++s) {
      if (s == r) continue;
      for (int64_t k = 0; k < nt; ++k) {
        bool seen = false;
        for (int64_t q = 0; q < nt && !seen; ++q)
          seen = classify(balance.mask, tiles[r * size_t(nt) + size_t(q)],
                          tiles[s * size_t(nt) + size_t(k)]) != TileKind::skip;
        if (seen) out[r] += std::min(local, (k + 1) * tile) - k * tile;
      }
    }
  return out;
}

int Layout::owner(int64_t t) const {
  CTXPAR_CHECK(t >= 0 && t < padded_, "layout: token ", t, " out of range [0, ", padded_, ")");
  switch (kind_) {
    case LayoutKind::balanced:
      return chunks_->owner[size_t(t / chunks_->size)];
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
    case LayoutKind::balanced:
      return chunks_->local[size_t(t / chunks_->size)] + t % chunks_->size;
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
  for (auto [b, e] : runs(rank)) {
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
    for (auto [b, e] : runs(r)) {
      const int64_t real_end = std::min(e, tokens_);
      if (real_end > b)
        copy_into(shards[r].slice(token_dim, i, i + (real_end - b)),
                  full.slice(token_dim, b, real_end));
      i += e - b;
    }
  }
}

}  // namespace ctxpar
