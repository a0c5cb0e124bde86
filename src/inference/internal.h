// Private pieces shared by the inference files: the cache's per-sequence shard, and what
// decode and prefill do to a cache (grow it within its limits, store rows, keep stats).
#pragma once
#include <cstdio>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include "ctxpar/agreement.h"
#include "ctxpar/clock.h"
#include "ctxpar/hash.h"
#include "ctxpar/inference.h"
#include "device/kernel_agreement.h"
#include "kernel/problem.h"
#include "strategy/call_record.h"

namespace ctxpar {

// One placement block of one sequence (or of several: forks share it copy-on-write): its
// rows k [1, block, Hkv, D] then v in `kv`, row t mod block of token t. Every rank has every
// page's id and refcount (the slot calls are the same on every rank); only the rank that holds
// the block, block mod P, has its memory.
struct KvCache::Page {
  int64_t refs = 0;   // block-table entries that name it, all sequences (0: the id is free)
  int64_t block = 0;  // the global block index it holds
  DeviceBuffer kv;    // empty on the other ranks
};

// One sequence: its block table, and this rank's tokens.
struct KvCache::Shard {
  bool live = true;    // false once freed (KvCache::free): the slot waits for add()
  int64_t length = 0;  // tokens of the whole sequence, all ranks
  // Page id of global block b (every rank's blocks: the same table on every rank); at least
  // the blocks of `length`, more after reserve(). Its hash kept (slot_table_hash, every call).
  std::vector<int64_t> pages;
  uint64_t table_hash = kFnv1a64Offset;
  // This rank's tokens, in increasing position (the placement rule keeps them so), per
  // sequence (a fork copies its prefix's: 8 or 12 bytes a token on the host, no K/V row).
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;  // only with a documents mask
  // k()/v(): this rank's rows, in their page or gathered into `copy` (local_rows), valid
  // while `gathered` is true.
  mutable DeviceBuffer copy;
  mutable std::pair<TensorView, TensorView> rows;
  mutable bool gathered = false;
};

// This rank's pages of a sequence in order, each a view of its tokens' rows [1, rows, Hkv, D]
// (every page `block` rows but the last).
struct PageViews {
  std::vector<TensorView> k, v;
};

struct InferenceAccess {
  // Makes the pages for the sequences to reach `lengths` (one per slot): plan_growth, then grow.
  static void reserve(KvCache& c, const std::vector<int64_t>& lengths) {
    grow(c, plan_growth(c, lengths));
  }
  // Checks that the sequences may reach `lengths`, changing nothing: every rank's tokens and
  // pages against the limits (the same verdict on every rank), then this rank's new pages
  // against memory_limit() (its own verdict: prefill agrees it with the others before any
  // change). Returns `lengths`, for grow.
  static std::vector<int64_t> plan_growth(KvCache& c, const std::vector<int64_t>& lengths);
  // The limits' check for `lengths` when rank r adds added[r] pages; throws naming the field.
  static void check_limits(KvCache& c, const std::vector<int64_t>& lengths,
                           const std::vector<int64_t>& added);
  // Pages each rank adds for the sequences to reach `lengths`: one for each block written that
  // has none, and a copy of each shared page written into (grow's order: exact).
  static std::vector<int64_t> added_pages(const KvCache& c, const std::vector<int64_t>& lengths);
  // Makes every page the writes up to `lengths` need, exclusive to its sequence (copy-on-write;
  // stream-ordered copies). Every rank the same ids.
  static void grow(KvCache& c, const std::vector<int64_t>& lengths);
  // Drops sequence seq's pages from block `keep` on (a page another sequence holds stays).
  static void drop_pages(KvCache& c, int64_t seq, int64_t keep);
  // A new page of global block `block` (refcount 1; its memory on the rank that holds it).
  static int64_t new_page(KvCache& c, int64_t block);
  static uint64_t table_hash(const KvCache& c, int64_t seq) { return c.shards_[seq]->table_hash; }
  // After a change of the block table: its hash again.
  static void table_changed(KvCache::Shard& s);
  static PageViews local_pages(const KvCache& c, int64_t seq);
  // This rank's rows [a, e) of sequence seq (a < e <= local_tokens) as k, v [1, e - a, Hkv,
  // D]: the page itself where they lie in one, else gathered into `scratch` (made or grown
  // here; stream-ordered copies): what a kernel that takes contiguous rows is given.
  static std::pair<TensorView, TensorView> local_rows(const KvCache& c, int64_t seq, int64_t a,
                                                      int64_t e, DeviceBuffer& scratch);
  // k()/v(): all of this rank's rows of sequence seq through local_rows into Shard::copy (once
  // per change of the sequence); `v`: the values, else the keys.
  static TensorView gathered(const KvCache& c, int64_t seq, bool v);
  // Gives the gathered copies back (prefill, at the end of its call).
  static void drop_copies(KvCache& c);
  // Stores rows of sequence seq: `indices` (increasing, all this rank's, following the ones it
  // holds) with k, v [1, m, Hkv, D] and m document ids (documents mask), into their pages
  // (grow made them exclusive). Enqueued copies.
  static void store(KvCache& c, int64_t seq, std::span<const int64_t> indices, const TensorView& k,
                    const TensorView& v, std::span<const int32_t> documents);
  // Stores the rows of the `count` = k.dim(1) new tokens of sequence seq (k, v [1, count, Hkv,
  // D], the same on every rank) that this rank holds, and counts them in the length.
  static void append_rows(KvCache& c, int64_t seq, const TensorView& k, const TensorView& v,
                          std::span<const int32_t> documents);
  static void set_length(KvCache& c, int64_t seq, int64_t n) { c.shards_[seq]->length = n; }
  // The slot add() / fork() take: the lowest free one, else slots() (a new one). Throws, naming
  // `what`, when every one of kMaxBatch slots is live.
  static int64_t free_slot(const KvCache& c, const char* what);
  static InferenceStats& stats(KvCache& c) { return c.stats_; }
  // The first prefill or decode of a cache: the ranks agree, collectively, before their first
  // exchange, on the cache's options (refused, naming the field, where ranks differ: a block or
  // a mask of its own would place or mask rows differently, a scale or bf16 tier of its own mix
  // two results, a limit of its own refuse on one rank only -- each without a word) and on the
  // bf16 products, kept in the cache's options (device/kernel_agreement.h). `what` names the
  // call in the error.
  static void agree_kernels(KvCache& c, const char* what) {
    if (c.kernels_agreed_) return;
    const KvCacheOptions& o = c.options_;
    char scale[32];
    std::snprintf(scale, sizeof scale, "%.9g", static_cast<double>(o.kernel.scale));
    require_agreement(
        c.comm_, what,
        {{"sequences (KvCacheOptions::sequences)", std::to_string(o.sequences)},
         {"kv_heads (KvCacheOptions::kv_heads)", std::to_string(o.kv_heads)},
         {"head_dim (KvCacheOptions::head_dim)", std::to_string(o.head_dim)},
         {"dtype (KvCacheOptions::dtype)", dtype_name(o.dtype)},
         {"block (KvCacheOptions::block)", std::to_string(o.block)},
         {"mask (KvCacheOptions::mask)", o.mask.describe()},
         {"scale (KvCacheOptions::kernel.scale)", scale},
         {"bf16 tier (KvCacheOptions::kernel.bf16_tier)", bf16_tier_name(o.kernel.bf16_tier)},
         {"merge (KvCacheOptions::merge)", decode_merge_name(o.merge)},
         {"decode_in_place (KvCacheOptions::decode_in_place)", o.decode_in_place ? "1" : "0"},
         {"max_tokens_per_rank (KvCacheOptions::max_tokens_per_rank)",
          std::to_string(o.max_tokens_per_rank)},
         {"max_bytes_per_rank (KvCacheOptions::max_bytes_per_rank)",
          std::to_string(o.max_bytes_per_rank)}},
        device::kernel_choices_error(o.kernel));
    device::agree_kernel_choices(c.comm_, c.options_.kernel);
    c.kernels_agreed_ = true;
  }
};

// Tokens among the first n of a sequence that `rank` of `ranks` holds (block round-robin).
int64_t placement_held_by(int64_t n, int rank, int ranks, int64_t block);
// Blocks of `block` tokens that n tokens take (the last one in part).
inline int64_t blocks_of(int64_t n, int64_t block) { return (n + block - 1) / block; }

// A partial attention result as it travels, to be merged with the other ranks':
// [O fp32 [B, rows, H, D] | LSE fp32 [B, H, rows]], from byte `at` of a buffer. Pass-Q's
// partials (one sequence's query rows) and decode's (every sequence's, with a signature after).
struct PartialLayout {
  int64_t batch, rows, heads, d;
  size_t o_bytes() const { return size_t(batch * rows * heads * d) * 4; }
  size_t bytes() const { return o_bytes() + size_t(batch * heads * rows) * 4; }
  TensorView o(const DeviceBuffer& b, size_t at = 0) const {
    return b.view(DType::f32, {batch, rows, heads, d}, at);
  }
  TensorView lse(const DeviceBuffer& b, size_t at = 0) const {
    return b.view(DType::f32, {batch, heads, rows}, at + o_bytes());
  }
};

// One call's InferenceStats from its record (strategy/call_record.h, the one record of a call):
// bytes counted by the communicator, wall and CPU time, the device's busy time. Prefill's mode
// and decode's merge time are the caller's to add.
void record_stats(InferenceStats& stats, const strategy::CallMeasure& m);

// The argument checks every call shares are kernel::check_activation's (kernel/finite.h, the
// one rule): q, k, v, out [B, T, H, D], and lse [B, H, T] fp32 with its shape given.
// Note [The cache checks K/V at the door]: every key and value is checked finite once, before
// it is stored (append, append_local, decode's new tokens: on every rank alike where every rank
// has the same rows, so all refuse together; prefill's rows, which are each rank's own, inside
// the verdict the ranks agree on before anything is stored or sent), and decode's kernel calls
// then skip the scan of the shard (KernelConfig::kv_checked) -- which for one new token cost as
// much as the attention. Queries are checked at the same door (a query the kernel refused after
// its call had stored the token's K/V left the token in the cache: a retry held it twice).
// t [B, n, H, D] in host memory: ctxpar::Error naming the first NaN / Inf by the sequence and
// token index where(b, t) gives (kv: a key or value, "kv head"). On the cuda device nothing is
// scanned (it reads no data on the host; docs/cuda.md).
void check_rows_finite(const char* what, const TensorView& t, const Device& dev,
                       const std::function<std::pair<int64_t, int64_t>(int64_t, int64_t)>& where,
                       bool kv = true);
// The K/V rows a call stores (append, append_local, prefill), before anything is: k, v
// [1, rows, Hkv, D] by the one activation rule, one document id each when the mask uses
// documents (`whose` rows, in the message), and finite (`where` names a row). Throws.
void check_new_kv(const KvCacheOptions& o, const Device& dev, const TensorView& k,
                  const TensorView& v, int64_t rows, std::span<const int32_t> documents,
                  const char* whose,
                  const std::function<std::pair<int64_t, int64_t>(int64_t, int64_t)>& where);
// Every slot's length (0 for a free one) once sequence seq has `count` more tokens.
std::vector<int64_t> lengths_after(const KvCache& cache, int64_t seq, int64_t count);
// The slot table (each slot live or free, its length and its block table) as hashes: what
// the ranks agree on in every prefill and decode, since the slot calls do not communicate
// (ranks that forked differently hold other block tables).
std::string slot_table_hash(const KvCache& cache);
// With KvCacheOptions::hash_inputs (resolved: its build default where unset): a hash of the
// values of `inputs` for the ranks to agree on; "" when off or on a device whose data the host
// does not read.
std::string inputs_hash(const KvCache& cache, std::initializer_list<TensorView> inputs);

}  // namespace ctxpar
