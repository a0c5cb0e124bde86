// Private pieces shared by the inference files: the cache's per-sequence shard, and what
// decode and prefill do to a cache (grow it within its limits, store rows, keep stats).
#pragma once
#include <chrono>
#include <cstdio>
#include <ctime>
#include <cstdint>
#include <functional>
#include <utility>
#include <span>
#include <string>
#include <vector>

#include "ctxpar/agreement.h"
#include "ctxpar/clock.h"
#include "ctxpar/inference.h"
#include "device/kernel_agreement.h"

namespace ctxpar {

// One sequence's share on this rank: k [1, capacity, Hkv, D] then v in `kv`; the first
// `local` slots hold tokens, in increasing position (the placement rule keeps them so).
struct KvCache::Shard {
  int64_t length = 0;    // tokens of the whole sequence, all ranks
  int64_t capacity = 0;  // token slots in kv
  DeviceBuffer kv;
  std::vector<int64_t> positions;  // reserved to capacity: never moves while ops are queued
  std::vector<int32_t> documents;  // only with a documents mask
};

struct InferenceAccess {
  // Makes room for the sequences to reach `lengths` (one per sequence): plan_growth, then grow.
  // `exact`: to the whole blocks needed (KvCache::reserve); else by the growth rule.
  static void reserve(KvCache& c, const std::vector<int64_t>& lengths, bool exact = false) {
    grow(c, plan_growth(c, lengths, exact));
  }
  // The token slots each of this rank's shards needs for `lengths`, changing nothing: checks
  // every rank's share against the limits (the same verdict on every rank), then this rank's
  // memory_limit() (its own verdict: prefill agrees it with the others before any change).
  static std::vector<int64_t> plan_growth(KvCache& c, const std::vector<int64_t>& lengths,
                                          bool exact = false);
  // Grows this rank's buffers to `capacities` (plan_growth's; stream-ordered copies).
  static void grow(KvCache& c, const std::vector<int64_t>& capacities);
  // Stores rows of sequence seq: `indices` (increasing, all this rank's, following the ones it
  // holds) with k, v [1, m, Hkv, D] and m document ids (documents mask). Enqueued copies.
  static void store(KvCache& c, int64_t seq, std::span<const int64_t> indices,
                    const TensorView& k, const TensorView& v, std::span<const int32_t> documents);
  // Stores the rows of the `count` = k.dim(1) new tokens of sequence seq (k, v [1, count, Hkv,
  // D], the same on every rank) that this rank holds, and counts them in the length.
  static void append_rows(KvCache& c, int64_t seq, const TensorView& k, const TensorView& v,
                          std::span<const int32_t> documents);
  static void set_length(KvCache& c, int64_t seq, int64_t n) { c.shards_[seq]->length = n; }
  static InferenceStats& stats(KvCache& c) { return c.stats_; }
  // The first prefill or decode of a cache: the ranks agree, collectively, before their first
  // exchange, on the cache's options (refused, naming the field, where ranks differ: a block or
  // a mask of its own would place or mask rows differently, a scale or bf16 tier of its own mix
  // two results, a limit of its own refuse on one rank only -- each without a word) and on the
  // machine's bf16 products (device/kernel_agreement.h). `what` names the call in the error.
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
         {"max_tokens_per_rank (KvCacheOptions::max_tokens_per_rank)",
          std::to_string(o.max_tokens_per_rank)},
         {"max_bytes_per_rank (KvCacheOptions::max_bytes_per_rank)",
          std::to_string(o.max_bytes_per_rank)}});
    device::agree_kernel_choices(c.comm_);
    c.kernels_agreed_ = true;
  }
};

// Tokens among the first n of a sequence that `rank` of `ranks` holds (block round-robin).
int64_t placement_held_by(int64_t n, int rank, int ranks, int64_t block);

// Token slots a shard of n tokens takes: whole blocks, doubling (0 for n = 0).
int64_t capacity_for(int64_t n, int64_t block);

// Fills the cache's InferenceStats for one call: bytes counted by the communicator, wall time
// and the device's busy time between construction and finish() (which synchronises first).
class CallStats {
 public:
  explicit CallStats(KvCache& cache)
      : cache_(cache), stats_(InferenceAccess::stats(cache)),
        counters_(cache.comm().counters()), device_(cache.device().counters()),
        t0_(std::chrono::steady_clock::now()), cpu0_(thread_cpu_seconds()) {
    stats_ = InferenceStats{};
  }
  InferenceStats& stats() { return stats_; }
  void finish() {
    cache_.device().synchronize();
    const CommCounters now = cache_.comm().counters();
    stats_.bytes_sent = now.bytes_sent - counters_.bytes_sent;
    stats_.bytes_received = now.bytes_received - counters_.bytes_received;
    stats_.attention_seconds = cache_.device().counters().busy_seconds - device_.busy_seconds;
    stats_.wall_seconds = seconds_since(t0_);
    stats_.cpu_seconds = thread_cpu_seconds() - cpu0_;
  }
  static double seconds_since(std::chrono::steady_clock::time_point t0) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }

 private:
  KvCache& cache_;
  InferenceStats& stats_;
  CommCounters counters_;
  DeviceCounters device_;
  std::chrono::steady_clock::time_point t0_;
  double cpu0_;
};

// The checks every call shares: a [B, T, H, D] activation of the cache's head dim and of fp32
// or bf16 (fp32 only when !bf16), with `what` naming the argument. Throws ctxpar::Error.
void check_rows(const char* what, const TensorView& t, int64_t b, int64_t tokens, int64_t heads,
                int64_t d, bool bf16 = true);
void check_lse(const char* what, const TensorView& t, int64_t b, int64_t heads, int64_t tokens);
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

}  // namespace ctxpar
