// KvCache: the K/V of B sequences spread over the ranks of a communicator, block round-robin.
// See docs/inference.md, "Placement".
//
//   token t of a sequence lives on rank (t / block) mod P, at local slot held_by(t, rank):
//
//     t:     0 .. 63 | 64 .. 127 | 128 .. 191 | 192 .. 255 | 256 .. 319 | ...   (block 64, P = 2)
//     rank:      0   |     1     |      0     |      1     |      0     | ...
//
// The pages that hold the rows, one per block of a sequence: kv_pages.cc.
#include <algorithm>
#include <cstring>

#include "ctxpar/error.h"
#include "ctxpar/hash.h"
#include "ctxpar/limits.h"
#include "kernel/finite.h"
#include "inference/internal.h"

namespace ctxpar {

const char* prefill_mode_name(PrefillMode m) {
  switch (m) {
    case PrefillMode::automatic:
      return "auto";
    case PrefillMode::pass_kv:
      return "pass-kv";
    case PrefillMode::pass_q:
      return "pass-q";
  }
  return "?";
}

PrefillMode parse_prefill_mode(const std::string& name) {
  if (name == "auto") return PrefillMode::automatic;
  if (name == "pass-kv") return PrefillMode::pass_kv;
  if (name == "pass-q") return PrefillMode::pass_q;
  throw Error("unknown prefill mode '" + name + "'; valid: auto, pass-kv, pass-q");
}

const char* decode_merge_name(DecodeMerge m) {
  switch (m) {
    case DecodeMerge::allgather:
      return "allgather";
    case DecodeMerge::chain:
      return "chain";
    case DecodeMerge::tree:
      return "tree";
  }
  return "?";
}

DecodeMerge parse_decode_merge(const std::string& name) {
  if (name == "allgather") return DecodeMerge::allgather;
  if (name == "chain") return DecodeMerge::chain;
  if (name == "tree") return DecodeMerge::tree;
  throw Error("unknown decode merge '" + name + "'; valid: allgather, chain, tree");
}

void check_rows_finite(const char* what, const TensorView& t, const Device& dev,
                       const std::function<std::pair<int64_t, int64_t>(int64_t, int64_t)>& where,
                       bool kv) {
  if (t.empty() || !dev.caps().finite_checks) return;
  const kernel::NonFinite f = kernel::find_non_finite(t);
  if (!f.found()) return;
  const auto [seq, index] = where(f.b, f.t);
  throw Error(detail::concat(what, ": non-finite value (", f.value, ") in sequence ", seq,
                             ", token ", index, kv ? ", kv head " : ", head ", f.h, ", dim ", f.d,
                             kv ? "; the KV cache stores no NaN / Inf (" : " (",
                             kernel::kNonFiniteHint, ")"));
}

void record_stats(InferenceStats& stats, const strategy::CallMeasure& m) {
  stats.bytes_sent = m.bytes_sent;
  stats.bytes_received = m.bytes_received;
  stats.attention_seconds = m.device.busy_seconds;
  stats.wall_seconds = m.wall_seconds;
  stats.cpu_seconds = m.cpu_seconds;
}

void check_cache_mask(const Mask& m, const char* what) {
  // Key j is visible to query i up to i + R (window), or up to i (causal): see mask.h.
  const bool unbounded_ahead = !m.causal && m.window_right < 0;
  CTXPAR_CHECK(!unbounded_ahead && m.window_right <= 0, what, " ", m.describe(),
               unbounded_ahead ? " lets a token see every later one"
                               : " names later tokens (a right window bound above 0)",
               ", which a KV cache cannot give: it holds only the tokens so far, so a token's "
               "attention would depend on how the sequence was cut into prefill calls; use "
               "causal or causal+window:L,0 (+documents where needed)");
}

KvCache::KvCache(Communicator& comm, const KvCacheOptions& options)
    : comm_(comm), options_(options) {
  const KvCacheOptions& o = options;
  // Before anything is allocated (a shard per sequence: an absurd count would allocate for a long time, then fail).
  CTXPAR_CHECK(o.sequences >= 0 && o.sequences <= kMaxBatch,
               "KvCacheOptions::sequences must be in [0, ", kMaxBatch, "], got ", o.sequences);
  CTXPAR_CHECK(o.kv_heads >= 1 && o.kv_heads <= kMaxHeads,
               "KvCacheOptions::kv_heads must be in [1, ", kMaxHeads, "], got ", o.kv_heads);
  CTXPAR_CHECK(o.head_dim >= 16 && o.head_dim <= 256,
               "KvCacheOptions::head_dim must be in 16..256 (the kernel's range), got ",
               o.head_dim);
  CTXPAR_CHECK(o.dtype == DType::f32 || o.dtype == DType::bf16,
               "KvCacheOptions::dtype must be fp32 or bf16, got ", dtype_name(o.dtype));
  CTXPAR_CHECK(o.block >= 1 && o.block <= (int64_t{1} << 30),
               "KvCacheOptions::block must be in 1..2^30 tokens, got ", o.block);
  check_cache_mask(o.mask, "KvCacheOptions::mask");
  CTXPAR_CHECK(o.max_tokens_per_rank >= 0,
               "KvCacheOptions::max_tokens_per_rank must be >= 0 (0: no limit), got ",
               o.max_tokens_per_rank);
  CTXPAR_CHECK(o.max_bytes_per_rank >= 0,
               "KvCacheOptions::max_bytes_per_rank must be >= 0 (0: no limit), got ",
               o.max_bytes_per_rank);
  device_ = make_device(o.device, comm.rank());
  for (int64_t b = 0; b < o.sequences; ++b) shards_.push_back(std::make_unique<Shard>());
}

KvCache::~KvCache() {
  try {
    device_->synchronize();
  } catch (...) {  // an error in flight already says what went wrong
  }
  shards_.clear();
  pages_.clear();  // before the device that made them
}

int KvCache::rank_of(int64_t index) const { return int((index / options_.block) % comm_.size()); }

int64_t KvCache::held_by(int64_t n, int rank) const {
  return placement_held_by(n, rank, comm_.size(), options_.block);
}

std::vector<int64_t> KvCache::placement(int64_t first, int64_t count, int rank) const {
  std::vector<int64_t> out;
  const int64_t block = options_.block, end = first + count;
  for (int64_t t = first; t < end;) {
    const int64_t block_end = std::min(end, (t / block + 1) * block);
    if (rank_of(t) == rank)
      for (int64_t i = t; i < block_end; ++i) out.push_back(i);
    t = block_end;
  }
  return out;
}

bool KvCache::live(int64_t seq) const {
  CTXPAR_CHECK(seq >= 0 && seq < slots(), "sequence ", seq, " out of range: the cache has ",
               slots(), " slots (KvCacheOptions::sequences, then add())");
  return shards_[seq]->live;
}

std::vector<int64_t> KvCache::live_sequences() const {
  std::vector<int64_t> out;
  for (int64_t s = 0; s < slots(); ++s)
    if (shards_[s]->live) out.push_back(s);
  return out;
}

int64_t KvCache::tokens(int64_t seq) const {
  CTXPAR_CHECK(live(seq), "sequence ", seq, " is free (freed, or never added): add() a ",
               "sequence and use the index it returns");
  return shards_[seq]->length;
}

// ---- slots ---------------------------------------------------------------------------------
// Not collective: each rank changes its own shards the same way (the placement rule depends on
// the token index alone), and prefill / decode agree on slot_table_hash before they change
// anything.

int64_t InferenceAccess::free_slot(const KvCache& c, const char* what) {
  for (int64_t s = 0; s < c.slots(); ++s)
    if (!c.shards_[s]->live) return s;
  CTXPAR_CHECK(c.slots() < kMaxBatch, what, ": every one of the ", kMaxBatch,
               " slots is live (the most a cache holds); free() a finished sequence first");
  return c.slots();
}

int64_t KvCache::add() {
  const int64_t s = InferenceAccess::free_slot(*this, "add");
  if (s == slots()) shards_.push_back(std::make_unique<Shard>());
  shards_[s]->live = true;
  return s;
}

void KvCache::free(int64_t seq) {
  tokens(seq);             // checks: live
  device_->synchronize();  // queued operations may still read the shard
  InferenceAccess::drop_pages(*this, seq, 0);
  *shards_[seq] = Shard{};
  shards_[seq]->live = false;
}

void KvCache::reset(int64_t seq) { truncate(seq, 0); }

void KvCache::truncate(int64_t seq, int64_t n) {
  const int64_t length = tokens(seq);
  CTXPAR_CHECK(n >= 0 && n <= length, "truncate: sequence ", seq, " has ", length,
               " tokens; keep n in 0..", length, " of them, got ", n);
  Shard& s = *shards_[seq];
  InferenceAccess::drop_pages(*this, seq, blocks_of(n, options_.block));
  // Positions increase, so the first held_by(n) of this rank's tokens are those below n.
  const size_t keep = size_t(held_by(n, comm_.rank()));
  s.positions.resize(keep);
  if (options_.mask.documents) s.documents.resize(keep);
  s.length = n;
  s.gathered = false;
}

int64_t KvCache::fork(int64_t seq, int64_t n) {
  const int64_t length = tokens(seq);
  if (n < 0) n = length;
  CTXPAR_CHECK(n <= length, "fork: sequence ", seq, " has ", length,
               " tokens; a fork keeps at most all of them (n <= ", length, ", or n < 0 for all), ",
               "got ", n);
  const int64_t to = InferenceAccess::free_slot(*this, "fork");
  std::vector<int64_t> lengths = lengths_after(*this, seq, 0);
  lengths.resize(size_t(std::max(slots(), to + 1)), 0);
  lengths[to] = n;
  // The fork's pages are the parent's: tokens grow, pages do not (on any rank).
  InferenceAccess::check_limits(*this, lengths, std::vector<int64_t>(size_t(ranks()), 0));
  // Checked: from here nothing refuses.
  if (to == slots()) shards_.push_back(std::make_unique<Shard>());
  const Shard& from = *shards_[seq];
  Shard& s = *shards_[to];
  s = Shard{};
  s.pages.assign(from.pages.begin(), from.pages.begin() + blocks_of(n, options_.block));
  for (int64_t id : s.pages) ++pages_[size_t(id)].refs;
  InferenceAccess::table_changed(s);
  const size_t m = size_t(held_by(n, comm_.rank()));
  s.positions.assign(from.positions.begin(), from.positions.begin() + m);
  if (options_.mask.documents)
    s.documents.assign(from.documents.begin(), from.documents.begin() + m);
  s.length = n;
  return to;
}

int64_t KvCache::local_tokens(int64_t seq) const {
  tokens(seq);  // checks seq: live
  return int64_t(shards_[seq]->positions.size());
}

TensorView KvCache::k(int64_t seq) const { return InferenceAccess::gathered(*this, seq, false); }

TensorView KvCache::v(int64_t seq) const { return InferenceAccess::gathered(*this, seq, true); }

Tokens KvCache::local_token_ids(int64_t seq) const {
  const Shard& s = *shards_[seq];
  const size_t n = size_t(local_tokens(seq));
  Tokens t;
  t.positions = std::span<const int64_t>(s.positions.data(), n);
  if (options_.mask.documents) t.documents = std::span<const int32_t>(s.documents.data(), n);
  return t;
}

void check_new_kv(const KvCacheOptions& o, const Device& dev, const TensorView& k,
                  const TensorView& v, int64_t rows, std::span<const int32_t> documents,
                  const char* whose,
                  const std::function<std::pair<int64_t, int64_t>(int64_t, int64_t)>& where) {
  kernel::check_activation("k", k, true, {1, rows, o.kv_heads, o.head_dim});
  kernel::check_activation("v", v, true, {1, rows, o.kv_heads, o.head_dim});
  CTXPAR_CHECK(!o.mask.documents || int64_t(documents.size()) == rows, "documents: the mask ",
               "uses documents: give one id per ", whose, " (", rows, "), got ", documents.size());
  check_rows_finite("k", k, dev, where);
  check_rows_finite("v", v, dev, where);
}

std::vector<int64_t> lengths_after(const KvCache& cache, int64_t seq, int64_t count) {
  std::vector<int64_t> lengths;
  for (int64_t s = 0; s < cache.slots(); ++s)
    lengths.push_back(cache.live(s) ? cache.tokens(s) : 0);
  lengths[seq] += count;
  return lengths;
}

std::string slot_table_hash(const KvCache& cache) {
  uint64_t h = kFnv1a64Offset, tables = kFnv1a64Offset;
  for (int64_t s = 0; s < cache.slots(); ++s) {
    const int64_t entry = cache.live(s) ? cache.tokens(s) : -1;
    h = fnv1a64(&entry, sizeof entry, h);
    const uint64_t table = InferenceAccess::table_hash(cache, s);
    tables = fnv1a64(&table, sizeof table, tables);
  }
  char text[96];
  std::snprintf(text, sizeof text, "%lld slots, lengths %016llx, block tables %016llx",
                (long long)cache.slots(), (unsigned long long)h, (unsigned long long)tables);
  return text;
}

std::string inputs_hash(const KvCache& cache, std::initializer_list<TensorView> inputs) {
#ifdef NDEBUG
  constexpr bool kBuildDefault = false;
#else
  constexpr bool kBuildDefault = true;
#endif
  KvCache& c = const_cast<KvCache&>(cache);
  if (!cache.options().hash_inputs.value_or(kBuildDefault) || !c.device().caps().finite_checks)
    return "";
  uint64_t h = kFnv1a64Offset;
  for (const TensorView& t : inputs) {
    if (t.empty()) continue;
    const Tensor dense = Tensor::copy_of(t);  // strided views hash by value, not by layout
    h = fnv1a64(dense.data(), dense.bytes(), h);
  }
  char text[20];
  std::snprintf(text, sizeof text, "%016llx", (unsigned long long)h);
  return text;
}

void KvCache::append(int64_t seq, const TensorView& k, const TensorView& v,
                     std::span<const int32_t> documents) {
  const int64_t count = k.ndim() == 4 ? k.dim(1) : 0, first = tokens(seq);
  check_new_kv(options_, *device_, k, v, count, documents, "new token", [&](int64_t, int64_t t) {
    return std::pair<int64_t, int64_t>{seq, first + t};
  });
  InferenceAccess::reserve(*this, lengths_after(*this, seq, count));
  InferenceAccess::append_rows(*this, seq, k, v, documents);
  device_->synchronize();
}

void KvCache::append_local(int64_t seq, int64_t count, const TensorView& k, const TensorView& v,
                           std::span<const int32_t> documents) {
  CTXPAR_CHECK(count >= 0, "append_local: count must be >= 0, got ", count);
  const std::vector<int64_t> mine = placement(tokens(seq), count, comm_.rank());
  const int64_t m = int64_t(mine.size());
  check_new_kv(options_, *device_, k, v, m, documents, "row of this rank", [&](int64_t, int64_t t) {
    return std::pair<int64_t, int64_t>{seq, mine[t]};
  });
  const std::vector<int64_t> lengths = lengths_after(*this, seq, count);
  InferenceAccess::reserve(*this, lengths);
  if (m > 0) InferenceAccess::store(*this, seq, mine, k, v, documents);
  InferenceAccess::set_length(*this, seq, lengths[seq]);
  device_->synchronize();
}

void InferenceAccess::append_rows(KvCache& c, int64_t seq, const TensorView& k, const TensorView& v,
                                  std::span<const int32_t> documents) {
  const int64_t n = c.tokens(seq), count = k.dim(1);
  const std::vector<int64_t> mine = c.placement(n, count, c.comm_.rank());
  // Mine are runs of whole blocks; store each run from its rows of k, v.
  for (size_t i = 0; i < mine.size();) {
    size_t j = i + 1;
    while (j < mine.size() && mine[j] == mine[j - 1] + 1) ++j;
    const int64_t r0 = mine[i] - n, r1 = mine[j - 1] + 1 - n;
    std::span<const int32_t> docs;
    if (c.options_.mask.documents) docs = documents.subspan(size_t(r0), size_t(r1 - r0));
    store(c, seq, std::span(mine).subspan(i, j - i), k.slice(1, r0, r1), v.slice(1, r0, r1), docs);
    i = j;
  }
  set_length(c, seq, n + count);
}

}  // namespace ctxpar
