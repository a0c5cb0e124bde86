// KvCache's pages: a sequence's rows read where they lie (or gathered), the bytes its pages
// count, and the pages made, copied on write, dropped and written within the limits. The slots,
// the placement and the appends that use them: kv_cache.cc.
//
// Each block of a sequence is one page (docs/inference.md, "Paged storage"): a rank's share
// is whole blocks, so a page lives on one rank; a sequence's block table names its pages, and
// forks share them copy-on-write. Nothing grows by copying: pages come one at a time.
#include <algorithm>
#include <unordered_map>

#include "ctxpar/error.h"
#include "ctxpar/hash.h"
#include "ctxpar/memory.h"
#include "inference/internal.h"

namespace ctxpar {
namespace {
size_t bytes_per_token(const KvCacheOptions& o) {
  return 2 * size_t(o.kv_heads * o.head_dim) * dtype_size(o.dtype) + 8 + (o.mask.documents ? 4 : 0);
}
// What the limits count for a page: its block of tokens (bytes_per_token each).
size_t page_bytes(const KvCacheOptions& o) { return size_t(o.block) * bytes_per_token(o); }
// A page's keys (values: the second half) [1, block, Hkv, D].
TensorView page_rows(const KvCacheOptions& o, const DeviceBuffer& kv, bool values) {
  return kv.view(o.dtype, {1, o.block, o.kv_heads, o.head_dim}, values ? kv.size() / 2 : 0);
}
}  // namespace

PageViews InferenceAccess::local_pages(const KvCache& c, int64_t seq) {
  const KvCacheOptions& o = c.options_;
  const KvCache::Shard& s = *c.shards_[seq];
  const int64_t n = int64_t(s.positions.size()), p = c.ranks(), me = c.comm_.rank();
  PageViews views;
  // This rank's i-th block is global block i P + me (block round-robin).
  for (int64_t i = 0, at = 0; at < n; ++i, at += o.block) {
    const DeviceBuffer& kv = c.pages_[size_t(s.pages[size_t(i * p + me)])].kv;
    const Shape shape{1, std::min(o.block, n - at), o.kv_heads, o.head_dim};
    views.k.push_back(kv.view(o.dtype, shape));  // rows of `block` apart: page_rows' layout
    views.v.push_back(kv.view(o.dtype, shape, kv.size() / 2));
  }
  return views;
}

std::pair<TensorView, TensorView> InferenceAccess::local_rows(const KvCache& c, int64_t seq,
                                                              int64_t a, int64_t e,
                                                              DeviceBuffer& scratch) {
  const KvCacheOptions& o = c.options_;
  const KvCache::Shard& s = *c.shards_[seq];
  const int64_t p = c.ranks(), me = c.comm_.rank(), block = o.block;
  // This rank's i-th block is global block i P + me (block round-robin).
  auto page = [&](int64_t i) -> const DeviceBuffer& {
    return c.pages_[size_t(s.pages[size_t(i * p + me)])].kv;
  };
  if (a / block == (e - 1) / block) {  // one page: read where it lies
    const DeviceBuffer& kv = page(a / block);
    const int64_t r0 = a % block, r1 = r0 + (e - a);
    return {page_rows(o, kv, false).slice(1, r0, r1), page_rows(o, kv, true).slice(1, r0, r1)};
  }
  Device& dev = *c.device_;
  const Shape shape{1, e - a, o.kv_heads, o.head_dim};
  const size_t half = size_t((e - a) * o.kv_heads * o.head_dim) * dtype_size(o.dtype);
  if (scratch.size() < 2 * half) {
    if (!scratch.empty()) dev.synchronize();  // queued operations may still read it
    // Whole blocks: a sequence read after each appended token gets a new buffer once a block.
    scratch = dev.alloc(2 * size_t(blocks_of(e - a, block) * block) * (half / size_t(e - a)));
  }
  const TensorView k = scratch.view(o.dtype, shape), v = scratch.view(o.dtype, shape, half);
  for (int64_t t = a; t < e;) {
    const int64_t r0 = t % block, r1 = std::min(block, r0 + (e - t)), at = t - a;
    const DeviceBuffer& kv = page(t / block);
    dev.copy(kComputeStream, page_rows(o, kv, false).slice(1, r0, r1),
             k.slice(1, at, at + r1 - r0));
    dev.copy(kComputeStream, page_rows(o, kv, true).slice(1, r0, r1), v.slice(1, at, at + r1 - r0));
    t += r1 - r0;
  }
  return {k, v};
}

TensorView InferenceAccess::gathered(const KvCache& c, int64_t seq, bool v) {
  const int64_t n = c.local_tokens(seq);  // checks seq: live
  if (n == 0) return TensorView();
  const KvCache::Shard& s = *c.shards_[seq];
  if (!s.gathered) {
    s.rows = local_rows(c, seq, 0, n, s.copy);
    s.gathered = true;
  }
  return v ? s.rows.second : s.rows.first;
}

void InferenceAccess::drop_copies(KvCache& c) {
  bool synchronized = false;
  for (auto& s : c.shards_) {
    if (s->copy.empty()) continue;
    if (!synchronized) c.device_->synchronize();  // queued operations may still read them
    synchronized = true;
    s->copy = DeviceBuffer();
    s->gathered = false;
  }
}

size_t KvCache::token_bytes() const { return bytes_per_token(options_); }

size_t KvCache::bytes() const {
  size_t pages = 0;
  for (const Page& p : pages_) pages += p.refs > 0 && !p.kv.empty();
  return pages * page_bytes(options_);
}

size_t KvCache::bytes_for(const std::vector<int64_t>& lengths, int rank) const {
  return kv_cache_bytes(options_, lengths, comm_.size(), rank);
}

size_t kv_cache_bytes(const KvCacheOptions& o, const std::vector<int64_t>& lengths, int ranks,
                      int rank) {
  size_t total = 0;
  for (int64_t n : lengths)
    total += size_t(blocks_of(placement_held_by(n, rank, ranks, o.block), o.block));
  return total * page_bytes(o);
}

// ---- pages within the limits ---------------------------------------------------------------

void KvCache::reserve(const std::vector<int64_t>& lengths) {
  CTXPAR_CHECK(int64_t(lengths.size()) == slots(), "reserve: give one length per ", "slot (",
               slots(), "), got ", lengths.size());
  std::vector<int64_t> at_least = lengths;
  for (size_t s = 0; s < lengths.size(); ++s) {
    CTXPAR_CHECK(live(int64_t(s)) || lengths[s] == 0, "reserve: slot ", s, " is free; give it ",
                 "length 0 (add() a sequence to use it), got ", lengths[s]);
    at_least[s] = live(int64_t(s)) ? std::max(lengths[s], tokens(int64_t(s))) : 0;
  }
  InferenceAccess::reserve(*this, at_least);
}

std::vector<int64_t> InferenceAccess::plan_growth(KvCache& c, const std::vector<int64_t>& lengths) {
  check_limits(c, lengths, added_pages(c, lengths));
  return lengths;
}

void InferenceAccess::check_limits(KvCache& c, const std::vector<int64_t>& lengths,
                                   const std::vector<int64_t>& added) {
  const KvCacheOptions& o = c.options_;
  const int p = c.comm_.size(), me = c.comm_.rank();
  std::vector<int64_t> pages(size_t(p), 0);  // every rank's now, a shared page once
  for (const KvCache::Page& page : c.pages_)
    if (page.refs > 0) ++pages[size_t(page.block % p)];
  const size_t page = page_bytes(o);
  // Every rank's share, so that every rank refuses together, before any change.
  for (int r = 0; r < p; ++r) {
    int64_t held = 0;
    for (int64_t n : lengths) held += c.held_by(n, r);
    CTXPAR_CHECK(o.max_tokens_per_rank == 0 || held <= o.max_tokens_per_rank, "KV cache: rank ", r,
                 " would hold ", held,
                 " tokens, over KvCacheOptions::max_tokens_per_rank = ", o.max_tokens_per_rank,
                 "; raise it, or spread the cache over more ranks (each "
                 "holds about 1/P of the tokens)");
    const size_t bytes = size_t(pages[size_t(r)] + added[size_t(r)]) * page;
    CTXPAR_CHECK(o.max_bytes_per_rank == 0 || double(bytes) <= o.max_bytes_per_rank,
                 "KV cache: rank ", r, " would hold ", bytes, " bytes (", held, " tokens, ",
                 pages[size_t(r)] + added[size_t(r)], " pages of ", o.block,
                 ", a page shared by forks once), over KvCacheOptions::max_bytes_per_rank = ",
                 o.max_bytes_per_rank, "; raise it, or spread the cache over more ranks");
  }
  const size_t want = size_t(added[size_t(me)]) * page;
  if (want > 0 && o.check_memory_limit) {
    const MemoryLimit limit = memory_limit();
    CTXPAR_CHECK(!limit.known() || double(want) <= limit.bytes, "KV cache: rank ", me,
                 " cannot grow its shard to ", size_t(pages[size_t(me)]) * page + want,
                 " bytes: ", limit.shortfall(double(want)),
                 " (or turn KvCacheOptions::check_memory_limit off at your own risk)");
  }
}

// added_pages and grow walk the same writes in the same order: the blocks [n / block,
// blocks_of(length)) of each sequence growing from n tokens, each either new or (copy-on-write)
// a copy of a page another sequence still holds.
std::vector<int64_t> InferenceAccess::added_pages(const KvCache& c,
                                                  const std::vector<int64_t>& lengths) {
  const int64_t block = c.options_.block, p = c.comm_.size();
  std::vector<int64_t> added(size_t(p), 0);
  std::unordered_map<int64_t, int64_t>
      refs;  // the refcounts grow would leave, where it changes one
  for (size_t seq = 0; seq < lengths.size() && seq < c.shards_.size(); ++seq) {
    const KvCache::Shard& s = *c.shards_[seq];
    if (!s.live || lengths[seq] <= s.length) continue;
    for (int64_t b = s.length / block; b < blocks_of(lengths[seq], block); ++b) {
      if (b < int64_t(s.pages.size())) {
        const int64_t id = s.pages[size_t(b)];
        int64_t& r = refs.try_emplace(id, c.pages_[size_t(id)].refs).first->second;
        if (r == 1) continue;  // its own
        --r;
      }
      ++added[size_t(b % p)];
    }
  }
  return added;
}

int64_t InferenceAccess::new_page(KvCache& c, int64_t block) {
  int64_t id = int64_t(c.pages_.size());
  if (c.free_pages_.empty()) {
    c.pages_.emplace_back();
  } else {
    id = c.free_pages_.back();
    c.free_pages_.pop_back();
  }
  KvCache::Page& page = c.pages_[size_t(id)];
  page.refs = 1;
  page.block = block;
  if (block % c.comm_.size() == c.comm_.rank()) {
    const KvCacheOptions& o = c.options_;
    page.kv = c.device_->alloc(2 * size_t(o.block * o.kv_heads * o.head_dim) * dtype_size(o.dtype));
  }
  return id;
}

void InferenceAccess::grow(KvCache& c, const std::vector<int64_t>& lengths) {
  const KvCacheOptions& o = c.options_;
  const int64_t block = o.block;
  for (size_t seq = 0; seq < lengths.size() && seq < c.shards_.size(); ++seq) {
    KvCache::Shard& s = *c.shards_[seq];
    if (!s.live || lengths[seq] <= s.length) continue;
    const size_t had = s.pages.size();
    bool copied = false;
    for (int64_t b = s.length / block; b < blocks_of(lengths[seq], block); ++b) {
      if (b == int64_t(s.pages.size())) {
        s.pages.push_back(new_page(c, b));
        continue;
      }
      const int64_t shared = s.pages[size_t(b)];
      if (c.pages_[size_t(shared)].refs == 1) continue;
      copied = true;
      const int64_t id = new_page(c, b);  // copy-on-write: this sequence writes into block b
      const KvCache::Page &from = c.pages_[size_t(shared)], &to = c.pages_[size_t(id)];
      if (!to.kv.empty())
        c.device_->copy(kComputeStream,
                        from.kv.view(o.dtype, {1, 2 * block, o.kv_heads, o.head_dim}),
                        to.kv.view(o.dtype, {1, 2 * block, o.kv_heads, o.head_dim}));
      --c.pages_[size_t(shared)].refs;
      s.pages[size_t(b)] = id;
    }
    if (copied || s.pages.size() != had) table_changed(s);
  }
}

void InferenceAccess::table_changed(KvCache::Shard& s) {
  s.table_hash = fnv1a64(s.pages.data(), s.pages.size() * sizeof s.pages[0]);
}

void InferenceAccess::drop_pages(KvCache& c, int64_t seq, int64_t keep) {
  KvCache::Shard& s = *c.shards_[seq];
  if (keep >= int64_t(s.pages.size())) return;
  c.device_->synchronize();  // queued operations may still read the pages
  for (size_t b = size_t(keep); b < s.pages.size(); ++b) {
    KvCache::Page& page = c.pages_[size_t(s.pages[b])];
    if (--page.refs > 0) continue;  // another sequence still holds it
    page.kv = DeviceBuffer();
    c.free_pages_.push_back(s.pages[b]);
  }
  s.pages.resize(size_t(keep));
  table_changed(s);
  s.gathered = false;
}

void InferenceAccess::store(KvCache& c, int64_t seq, std::span<const int64_t> indices,
                            const TensorView& k, const TensorView& v,
                            std::span<const int32_t> documents) {
  KvCache::Shard& s = *c.shards_[seq];
  const KvCacheOptions& o = c.options_;
  Device& dev = *c.device_;
  // Each run of consecutive indices within one block goes to its page in one copy.
  for (size_t i = 0; i < indices.size();) {
    const int64_t b = indices[i] / o.block, r0 = indices[i] % o.block;
    size_t j = i + 1;
    while (j < indices.size() && indices[j] == indices[j - 1] + 1 && indices[j] / o.block == b) ++j;
    const KvCache::Page* page =
        b < int64_t(s.pages.size()) ? &c.pages_[size_t(s.pages[size_t(b)])] : nullptr;
    CTXPAR_CHECK(page && page->refs == 1 && !page->kv.empty(),
                 "KV cache: store into a page grow() did not make (internal)");
    const int64_t r1 = r0 + int64_t(j - i);
    dev.copy(kComputeStream, k.slice(1, int64_t(i), int64_t(j)),
             page_rows(o, page->kv, false).slice(1, r0, r1));
    dev.copy(kComputeStream, v.slice(1, int64_t(i), int64_t(j)),
             page_rows(o, page->kv, true).slice(1, r0, r1));
    i = j;
  }
  s.positions.insert(s.positions.end(), indices.begin(), indices.end());
  if (o.mask.documents) s.documents.insert(s.documents.end(), documents.begin(), documents.end());
  s.gathered = false;
}

}  // namespace ctxpar
