// Long-context inference with the KV cache spread over the ranks of a communicator: prefill
// (pass-KV or pass-Q) and decode (each rank attends over its shard; the partial (O, LSE) pairs
// merge exactly, in rank order). After Yang et al. 2024, "Context Parallelism for Scalable
// Million-Token Inference". See docs/inference.md (with diagrams).
//
// Shapes (per call, row-major as in kernel.h):
//   cache shard of sequence b   k, v [1, n_r, Hkv, D]   fp32 or bf16 (KvCacheOptions::dtype)
//   decode                      q, out [B, Tn, Hq, D]; k_new, v_new [B, Tn, Hkv, D];
//                               lse [B, Hq, Tn] fp32 — the same on every rank
//   prefill (one sequence)      q, out [1, Tl, Hq, D]; k, v [1, Tl, Hkv, D]; lse [1, Hq, Tl]:
//                               this rank's Tl rows of the T new tokens (KvCache::placement)
// Token t of a sequence (0-based) has global position t and lives on rank (t / block) mod P
// ("block round-robin"): every rank's share stays within one block of the others', new tokens
// never move old ones, and where a token lives depends on t alone (not on how the sequence
// was cut into prefill and decode calls), so decode results are bitwise the same whatever
// was prefilled before.
#pragma once
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

// How decode merges the ranks' partial results (docs/inference.md, "The merge across ranks"):
//   allgather  every rank gathers all P partials and merges them in rank order (one collective)
//   chain      rank r merges the partial of ranks 0..r-1 with its own and passes it on; the last
//              rank sends the result to all (2 (P-1) latencies, rank order: allgather's bits)
//   tree       recursive doubling (Tree Attention's allreduce form): log2 P rounds of pairwise
//              exchange, each pair merging lower rank first (other bits than rank order, the
//              same on every rank and run)
enum class DecodeMerge { allgather, chain, tree };
const char* decode_merge_name(DecodeMerge m);
DecodeMerge parse_decode_merge(const std::string& name);  // "allgather" | "chain" | "tree"

struct KvCacheOptions {
  // Sequences live at construction (slots 0..sequences-1, each with its own length),
  // 0..kMaxBatch; KvCache::add makes more (up to kMaxBatch slots), KvCache::free ends one.
  int64_t sequences = 1;
  int64_t kv_heads = 1;         // Hkv, 1..kMaxHeads
  int64_t head_dim = 64;        // D (16..256)
  DType dtype = DType::f32;     // k, v storage: fp32 or bf16
  int64_t block = kKernelTile;  // placement block (tokens); a kernel tile by default
  // The attention's mask (documents: a document id per token): one that hides every later
  // token (check_cache_mask), causal by default ("none", the default of Mask, is refused).
  Mask mask = Mask::causal_mask();
  KernelConfig kernel;   // prefill and decode; bf16_tier the same on every rank
  DeviceOptions device;  // each rank makes its own device of this kind
  // Limits per rank; a call that would pass one is refused before anything changes, with an
  // Error naming the field (every rank computes every rank's share, so all refuse together).
  // Bytes count the pages (whole blocks of tokens, kv_cache_bytes), a page shared by forks
  // once; tokens count every sequence's own (what decode reads), shared or not.
  int64_t max_tokens_per_rank = 0;  // tokens of all sequences on one rank; 0: no limit
  double max_bytes_per_rank = 0;    // bytes of the pages on one rank; 0: no limit
  // Also refuse growth beyond ctxpar::memory_limit() (memory.h) of this process.
  bool check_memory_limit = true;
  // Decode and prefill also agree on a hash of the values of q and the new K/V, so that ranks
  // passing different queries are refused instead of merged (costs a pass over the inputs).
  // Unset: on in a debug build of the library (NDEBUG not defined), off in a release build.
  // Not on the cuda device (it reads no input on the host; DeviceCaps::finite_checks).
  std::optional<bool> hash_inputs;
  // How decode merges the ranks' partials (the same on every rank: agreed).
  DecodeMerge merge = DecodeMerge::allgather;
  // Decode's kernel: true reads the shard where it lies (docs/inference.md, "Decode reads the
  // cache in place"), on the cpu and sim devices for a mask without documents; false, or
  // elsewhere, the tile kernel's path (the reference the in-place kernel is measured and tested
  // against). The same on every rank (the two round differently).
  bool decode_in_place = true;
};

// The one rule for a cache's mask (the KvCache constructor, ctxpar.KVCache and `ctxpar decode`
// hold to it): no query may see a key after it. The cache holds only the tokens so far, so a
// mask that looks ahead ("none", window:L,R with R != 0) would make a token's attention depend
// on how the sequence was cut into prefill calls. Accepted: causal, window:L,0 and
// causal+window:L,0 (L >= -1), with or without documents; a positive right bound is refused
// even under causal, which would hide the later keys it names. Throws Error naming `what` (the
// option in the caller's words: "KvCacheOptions::mask", "--mask", "mask").
void check_cache_mask(const Mask& mask, const char* what);

// Times each DecodeMerge of decode's partials (options.sequences sequences of tn new tokens, hq
// query heads) on comm: `reps` merges each, the slowest rank's mean. Collective; the picks are
// the same on every rank. `fastest` is the faster of allgather and chain, which give the same
// bits (what `ctxpar decode --merge auto` takes: a run's answer must not depend on a timing);
// `fastest_any` may be the tree (other bits: taken only when asked for).
struct DecodeMergeTimes {
  double allgather = 0, chain = 0, tree = 0;  // seconds per merge
  DecodeMerge fastest = DecodeMerge::allgather, fastest_any = DecodeMerge::allgather;
};
DecodeMergeTimes time_decode_merges(Communicator& comm, const KvCacheOptions& options, int64_t hq,
                                    int64_t tn = 1, int reps = 50);

enum class PrefillMode { automatic, pass_kv, pass_q };
const char* prefill_mode_name(PrefillMode m);
PrefillMode parse_prefill_mode(const std::string& name);  // "auto" | "pass-kv" | "pass-q"

// What one rank did in the last decode / prefill call.
struct InferenceStats {
  uint64_t bytes_sent = 0, bytes_received = 0;  // this rank, counted by the communicator
  double wall_seconds = 0;
  double attention_seconds = 0;  // inside kernel operations (the device's busy time)
  double merge_seconds = 0;      // decode: all-gather of the partials and their merge
  double cpu_seconds = 0;        // CPU time of the calling thread (the cpu device runs inline)
  PrefillMode mode = PrefillMode::automatic;  // prefill: the mode that ran
};

class KvCache {
 public:
  // Checks the options (Error naming the field). Not collective: no communication.
  KvCache(Communicator& comm, const KvCacheOptions& options);
  ~KvCache();
  KvCache(const KvCache&) = delete;
  KvCache& operator=(const KvCache&) = delete;

  const KvCacheOptions& options() const { return options_; }
  Communicator& comm() { return comm_; }
  Device& device() { return *device_; }
  int ranks() const { return comm_.size(); }

  // The placement rule (pure functions of the token index; any rank may ask about any rank).
  int rank_of(int64_t index) const;
  // Tokens among the first n of a sequence that rank r holds.
  int64_t held_by(int64_t n, int rank) const;
  // Indices in [first, first + count) that rank r holds, increasing.
  std::vector<int64_t> placement(int64_t first, int64_t count, int rank) const;

  // ---- slots: what a server needs (docs/inference.md, "A server's cache") --------------
  // Slots 0..slots()-1, each live or free. None of these communicate: every rank must make
  // the same calls, and the next prefill / decode refuses ranks whose slot tables differ
  // (naming the field) before anything changes. A refused call changes nothing.
  int64_t slots() const { return int64_t(shards_.size()); }
  bool live(int64_t seq) const;                 // seq in range; false once freed
  std::vector<int64_t> live_sequences() const;  // increasing
  // A new empty sequence: the lowest free slot (a freed slot is reused), else a new slot (at
  // most kMaxBatch). Returns its index.
  int64_t add();
  // Ends sequence seq and gives its pages back (a page a fork still holds stays for it); the
  // slot is free for add().
  void free(int64_t seq);
  // Empties sequence seq (length 0), keeping it live; its pages are given back.
  void reset(int64_t seq);
  // Keeps the first n tokens of sequence seq (0 <= n <= tokens(seq)): rolls back rejected
  // speculative tokens. Drops the pages past the block of token n (docs/inference.md, "Paged
  // storage"); a page still shared with another sequence stays for it.
  void truncate(int64_t seq, int64_t n);
  // A new sequence (add()'s slot) holding the first n tokens of sequence seq (n < 0: all of
  // them; else n <= tokens(seq)): many samples of one prompt, beam search. Shares the pages of
  // those tokens copy-on-write: no K/V row is copied (O(pages), no communication), and a page
  // is copied only when one of its sequences writes into it while another still holds it.
  // Checked against the limits like an append (shared pages count once).
  int64_t fork(int64_t seq, int64_t n = -1);

  int64_t tokens(int64_t seq) const;        // global length of live sequence seq
  int64_t local_tokens(int64_t seq) const;  // held by this rank
  // This rank's shard of sequence seq: k, v [1, n_r, Hkv, D] and their tokens (valid until the
  // next call that changes the sequence). The rows lie in pages: k and v gather them into one
  // copy on demand (kept until the sequence changes; decode's in-place kernel reads the pages).
  TensorView k(int64_t seq) const;
  TensorView v(int64_t seq) const;
  Tokens local_token_ids(int64_t seq) const;
  // Bytes of this rank's pages now (one page per placement block, a page shared by forks
  // counted once; reserved pages included), and what rank r needs for `lengths` tokens per
  // slot in whole blocks without sharing (the arithmetic the limits use, the same on every
  // rank). reserve takes one length per slot (0 for a free one).
  size_t bytes() const;
  size_t bytes_for(const std::vector<int64_t>& lengths, int rank) const;
  // Makes the pages for `lengths` tokens per sequence at once (and copies now the shared pages
  // an append up to them would write into), so that appending up to them takes no more memory.
  // Checked like an append.
  void reserve(const std::vector<int64_t>& lengths);
  size_t token_bytes() const;  // one token's k + v + position (+ document id)

  // Appends the K/V of `count` new tokens to sequence seq: k, v [1, count, Hkv, D] hold every
  // new token (the same on every rank); each rank keeps the ones the rule gives it. documents
  // has `count` ids when the mask uses documents. No communication.
  void append(int64_t seq, const TensorView& k, const TensorView& v,
              std::span<const int32_t> documents = {});

  // The same for a rank that has only its own rows: k, v [1, m, Hkv, D] are the rows
  // placement(tokens(seq), count, rank()) of the `count` new tokens. Every rank must call it
  // with the same count (no communication checks that).
  void append_local(int64_t seq, int64_t count, const TensorView& k, const TensorView& v,
                    std::span<const int32_t> documents = {});

  const InferenceStats& last_stats() const { return stats_; }

 private:
  friend struct InferenceAccess;
  struct Shard;
  struct Page;
  Communicator& comm_;
  KvCacheOptions options_;
  std::unique_ptr<Device> device_;
  std::vector<std::unique_ptr<Shard>> shards_;  // one per sequence
  // Every rank's pages by id (the same ids on every rank; the memory on the holding rank only)
  // and the free ids, reused last-freed first (docs/inference.md, "Paged storage").
  std::vector<Page> pages_;
  std::vector<int64_t> free_pages_;
  InferenceStats stats_;
  bool kernels_agreed_ = false;  // the first prefill / decode agreed the kernel choices
};

// Bytes rank `rank` (of `ranks`) needs when the sequences have `lengths` tokens, in whole
// blocks: KvCache::bytes_for without a communicator (the CLI's check before it starts).
size_t kv_cache_bytes(const KvCacheOptions& options, const std::vector<int64_t>& lengths, int ranks,
                      int rank);

// Decode: Tn new tokens (usually 1) of every live sequence (in slot order) at once, sequences
// of any lengths; the overload with `seqs` decodes those (distinct, live) sequences only, in
// that order: q [len(seqs), Tn, Hq, D] (continuous batching: any subset of the live ones).
// The ranks agree, before anything changes, on the sequences, their lengths, the slot table,
// the shapes (and with KvCacheOptions::hash_inputs the inputs' values), refusing with the
// field named.
// Appends their K/V (each on the rank the rule names), then every rank attends q over its
// shards, and the P partial (O, LSE) pairs are all-gathered and merged in rank order 0..P-1
// (merge(), kernel.h): out and lse are bitwise the same on every rank, and for given inputs
// do not depend on how earlier tokens were prefilled or decoded. documents: B * Tn ids
// (row-major) when the mask uses documents. Collective.
void decode(KvCache& cache, const TensorView& q, const TensorView& k_new, const TensorView& v_new,
            const TensorView& out, const TensorView& lse, std::span<const int32_t> documents = {});
void decode(KvCache& cache, std::span<const int64_t> seqs, const TensorView& q,
            const TensorView& k_new, const TensorView& v_new, const TensorView& out,
            const TensorView& lse, std::span<const int32_t> documents = {});

// Bytes that prefilling `new_tokens` after `cached` tokens of one sequence moves, all ranks
// together, in each mode (exactly what the communicators count):
//   pass-KV: every shard (cache + new rows) travels P-1 hops: (P-1) * sum_r kv_bytes(n_r)
//   pass-Q:  every rank's query rows travel P-1 hops, and P-1 partial (O, LSE) of each go home:
//            (P-1) * sum_r Tl_r * (Hq * D * q_bytes + 8 [+4] + Hq * (D + 1) * 4)
// pass-Q moves fewer when the cache is much longer than the new tokens (C >> T).
struct PrefillBytes {
  uint64_t pass_kv = 0, pass_q = 0;
};
struct PrefillShape {
  int64_t cached = 0, new_tokens = 0;
  int ranks = 1;
  int64_t hq = 1, hkv = 1, head_dim = 64, block = kKernelTile;
  DType kv_dtype = DType::f32, q_dtype = DType::f32;
  bool documents = false;
};
PrefillBytes predict_prefill_bytes(const PrefillShape& shape);
// The mode with fewer bytes (pass-KV on a tie); `forced` other than automatic wins.
PrefillMode choose_prefill(const PrefillShape& shape, PrefillMode forced = PrefillMode::automatic);

// ---- planning (src/inference/plan.cc; `ctxpar decode --plan`) -------------------------------
// What the planner needs of a machine: measured by measure_inference_rates() or given.
struct InferenceRates {
  double decode_seconds_per_token_head = 0;  // decode kernel: per cached token and KV head
                                             // (its g query rows), one rank
  double attention_flops = 0;        // prefill kernel FLOP/s per rank (4 D FLOPs per pair and head)
  double link_bytes_per_second = 0;  // one message between two ranks, one direction
  double message_seconds = 0;  // fixed cost per message (latency, and decode's merge per rank)
};
// Measures the rates on this machine with the threads transport and `options`' device and
// kernel (about a second): a one-rank decode and prefill, and a two-rank exchange.
InferenceRates measure_inference_rates(const KvCacheOptions& options, int64_t hq);

// Decode of Tn tokens of every sequence (lengths: the sequences' lengths before the call).
struct DecodePlan {
  std::vector<int64_t> tokens_per_rank;  // cached tokens after the call, all sequences
  std::vector<uint64_t> cache_bytes;     // kv_cache_bytes per rank (whole blocks)
  uint64_t bytes_per_call = 0;           // sent, all ranks together (what the counters count)
  double kernel_seconds = 0;             // the fullest rank's attention
  double merge_seconds = 0;              // all-gather and merge of the P partials
  double seconds = 0;                    // kernel + merge
};
DecodePlan plan_decode(const KvCacheOptions& options, int64_t hq, int64_t tn,
                       const std::vector<int64_t>& lengths, int ranks, const InferenceRates& rates);

// Prefill of shape.new_tokens after shape.cached tokens in each mode: bytes (exact, as
// predict_prefill_bytes), seconds (the slowest rank's compute plus the transfers it cannot
// hide: the ring's hops beyond its steps' compute; pass-Q's partials going home after the
// ring), and the crossovers for this T: the least cached length from which pass-Q moves fewer
// bytes (resp. takes less time) than pass-KV; -1 when it never does within 2^40 tokens.
struct PrefillPlan {
  PrefillBytes bytes;
  double pass_kv_seconds = 0, pass_q_seconds = 0;
  PrefillMode chosen = PrefillMode::pass_kv;  // choose_prefill's (by bytes)
  int64_t crossover_bytes = -1, crossover_seconds = -1;
};
PrefillPlan plan_prefill(const PrefillShape& shape, bool causal, const InferenceRates& rates);

// Prefill of `new_tokens` tokens of sequence seq after its cached ones: q, k, v hold this
// rank's rows of them (cache.placement(tokens(seq), new_tokens, rank)); out, lse receive the
// attention of those rows over the whole sequence (cache and new tokens, under the mask).
// Appends the new K/V to this rank's shard. Returns the mode that ran. Collective.
PrefillMode prefill(KvCache& cache, int64_t seq, int64_t new_tokens, const TensorView& q,
                    const TensorView& k, const TensorView& v, const TensorView& out,
                    const TensorView& lse, PrefillMode mode = PrefillMode::automatic,
                    std::span<const int32_t> documents = {});

// Several prompts of different lengths in one call: each request as the call above (its
// sequence distinct and live). Every request is checked, and the ranks agree on all of them,
// before any is stored or sent: one bad request refuses the whole call and changes nothing.
// Returns each request's mode. Collective.
struct PrefillRequest {
  int64_t seq = 0, new_tokens = 0;
  TensorView q, k, v, out, lse;
  std::span<const int32_t> documents;
};
std::vector<PrefillMode> prefill(KvCache& cache, std::span<const PrefillRequest> requests,
                                 PrefillMode mode = PrefillMode::automatic);

}  // namespace ctxpar
