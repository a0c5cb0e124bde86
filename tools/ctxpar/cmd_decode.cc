// ctxpar decode: long-context inference with the KV cache spread over the ranks. Fills each
// sequence's cache with a context (random, or the keys / values of .npy files), by prefill
// attention (pass-KV or pass-Q) or by storing the K/V alone, then decodes tokens one per step
// and reports the per-token latency, the bytes moved and the cache's memory per rank.
// See docs/inference.md.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_job.h"
#include "commands.h"
#include "ctxpar/comm.h"
#include "ctxpar/error.h"
#include "ctxpar/gloo.h"
#include "ctxpar/hash.h"
#include "ctxpar/inference.h"
#include "ctxpar/memory.h"
#include "ctxpar/npy.h"
#include "options.h"
#include "rank_agreement.h"

namespace ctxpar::cli {
namespace {

struct DecodeConfig {
  std::vector<int64_t> context;  // per sequence
  int64_t tokens = 16, hq = 8, chunk = 0;
  KvCacheOptions cache;
  bool attend = true;
  PrefillMode mode = PrefillMode::automatic;
  uint64_t seed = 1;
  std::string k_npy, v_npy;
  bool json = false;
};

// Rows of a random tensor [1, n, H, D] at `indices`, each token's row drawn from its own seed
// (token_seed, as `ctxpar attention` draws): the values depend on neither P nor --block, and a
// rank draws only its own rows (drawing whole blocks took 58 s for 100 tokens at --block 4M).
Tensor random_rows(const std::vector<int64_t>& indices, int64_t heads, int64_t d, uint64_t seed,
                   int which, int64_t seq, DType dtype) {
  Tensor out(DType::f32, {1, int64_t(indices.size()), heads, d});
  for (size_t i = 0; i < indices.size(); ++i)
    fill_normal(out.view().slice(1, int64_t(i), int64_t(i) + 1),
                token_seed(seed, which, seq, indices[i]));
  return Tensor::copy_of(out, dtype);
}

// This rank's rows of the context's keys or values, from the .npy file or drawn at random.
Tensor context_rows(const DecodeConfig& c, const std::string& npy, const std::vector<int64_t>& rows,
                    int64_t seq, int which) {
  const KvCacheOptions& o = c.cache;
  if (npy.empty()) return random_rows(rows, o.kv_heads, o.head_dim, c.seed, which, seq, o.dtype);
  const NpyHeader h = read_npy_header(npy);
  const int token_dim = h.shape.size() == 4 ? 1 : 0;
  const Tensor t = read_npy_rows(npy, token_dim, rows, o.dtype);  // contiguous
  return Tensor::copy_of(TensorView(t.data(), t.dtype(),
                                    {1, int64_t(rows.size()), o.kv_heads, o.head_dim}));
}

struct Report {
  std::vector<double> step_seconds;     // rank 0's decode() wall time per step
  double prefill_seconds = 0, merge_seconds = 0;
  uint64_t prefill_bytes = 0, decode_bytes = 0;  // all ranks together
  std::vector<uint64_t> cache_bytes;    // per rank, at the end
  std::vector<double> cpu_seconds;      // per rank: decode's CPU time (its thread), all steps
  std::string prefill_mode;  // the modes the prefill calls ran ("pass-kv+pass-q"), or "fill"
  // FNV-1a of every step's out and lse, which are bitwise the same on every rank and transport
  // for the same P (docs/inference.md, "Decode"): `--json`'s way to compare two runs' answers.
  uint64_t outputs_hash = kFnv1a64Offset;
};

void run_rank(Communicator& comm, const DecodeConfig& c, Report& report) {
  KvCache cache(comm, c.cache);
  const KvCacheOptions& o = c.cache;
  const int me = comm.rank();
  const int64_t nseq = o.sequences, d = o.head_dim;
  std::vector<int64_t> lengths;
  for (int64_t n : c.context) lengths.push_back(n + c.tokens);
  cache.reserve(lengths);  // no growth (copies, spare room) while it prefills and decodes
  uint64_t sent0 = comm.counters().bytes_sent;
  auto t0 = std::chrono::steady_clock::now();
  std::string mode = c.attend ? "" : "fill";
  for (int64_t s = 0; s < nseq; ++s) {
    const int64_t chunk = c.chunk > 0 ? c.chunk : std::max<int64_t>(1, c.context[s]);
    for (int64_t at = 0; at < c.context[s]; at += chunk) {
      const int64_t t = std::min(chunk, c.context[s] - at);
      const std::vector<int64_t> rows = cache.placement(at, t, me);
      const Tensor k = context_rows(c, c.k_npy, rows, s, 1), v = context_rows(c, c.v_npy, rows, s, 2);
      if (!c.attend) {
        cache.append_local(s, t, k, v);
        continue;
      }
      const Tensor q = random_rows(rows, c.hq, d, c.seed, 0, s, o.dtype);
      const int64_t tl = int64_t(rows.size());
      Tensor out(DType::f32, {1, tl, c.hq, d}), lse(DType::f32, {1, c.hq, tl});
      const std::string ran = prefill_mode_name(prefill(cache, s, t, q, k, v, out, lse, c.mode));
      if (mode.find(ran) == std::string::npos) mode += (mode.empty() ? "" : "+") + ran;
    }
  }
  comm.barrier();
  const double prefill_seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const uint64_t prefill_sent = comm.counters().bytes_sent - sent0;
  sent0 = comm.counters().bytes_sent;
  std::vector<double> steps;
  double merge = 0, cpu = 0;
  uint64_t outputs_hash = kFnv1a64Offset;
  for (int64_t step = 0; step < c.tokens; ++step) {
    Tensor q(DType::f32, {nseq, 1, c.hq, d}), k(DType::f32, {nseq, 1, o.kv_heads, d}),
        v(DType::f32, {nseq, 1, o.kv_heads, d});
    fill_normal(q, c.seed * 7919 + uint64_t(step) * 3 + 1);
    fill_normal(k, c.seed * 7919 + uint64_t(step) * 3 + 2);
    fill_normal(v, c.seed * 7919 + uint64_t(step) * 3 + 3);
    Tensor out(DType::f32, {nseq, 1, c.hq, d}), lse(DType::f32, {nseq, c.hq, 1});
    const Tensor qs = Tensor::copy_of(q, o.dtype), ks = Tensor::copy_of(k, o.dtype),
                 vs = Tensor::copy_of(v, o.dtype);
    const auto s0 = std::chrono::steady_clock::now();
    decode(cache, qs, ks, vs, out, lse);
    steps.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s0).count());
    merge += cache.last_stats().merge_seconds;
    cpu += cache.last_stats().cpu_seconds;
    outputs_hash = fnv1a64(lse.data(), lse.bytes(), fnv1a64(out.data(), out.bytes(), outputs_hash));
  }
  const uint64_t decode_sent = comm.counters().bytes_sent - sent0;
  // Every rank's figures to rank 0 (one small all-gather: [prefill bytes, decode bytes, cache,
  // decode CPU nanoseconds]).
  const uint64_t mine[4] = {prefill_sent, decode_sent, uint64_t(cache.bytes()),
                            uint64_t(cpu * 1e9)};
  std::vector<uint64_t> all(4 * size_t(comm.size()));
  comm.allgather(mine, all.data(), sizeof mine);
  if (me != 0) return;
  report.step_seconds = steps;
  report.prefill_seconds = prefill_seconds;
  report.merge_seconds = merge;
  report.prefill_mode = mode;
  report.outputs_hash = outputs_hash;
  for (int r = 0; r < comm.size(); ++r) {
    report.prefill_bytes += all[4 * r];
    report.decode_bytes += all[4 * r + 1];
    report.cache_bytes.push_back(all[4 * r + 2]);
    report.cpu_seconds.push_back(double(all[4 * r + 3]) * 1e-9);
  }
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

void print(const DecodeConfig& c, int ranks, const std::string& transport, const Report& r) {
  double sum = 0;
  for (double s : r.step_seconds) sum += s;
  const double mean = r.step_seconds.empty() ? 0 : sum / double(r.step_seconds.size());
  const uint64_t cmax = *std::max_element(r.cache_bytes.begin(), r.cache_bytes.end());
  const uint64_t cmin = *std::min_element(r.cache_bytes.begin(), r.cache_bytes.end());
  int64_t total = 0;
  for (int64_t n : c.context) total += n;
  std::string cpu;  // per rank, mean per decoded token
  for (double s : r.cpu_seconds) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%s%.6g", cpu.empty() ? "" : ", ",
                  c.tokens ? s / double(c.tokens) : 0.0);
    cpu += buf;
  }
  if (c.json) {
    std::printf("{\"command\": \"decode\", \"transport\": \"%s\", \"ranks\": %d, \"sequences\": %lld, "
                "\"context_tokens\": %lld, \"decoded_tokens\": %lld, \"heads\": %lld, "
                "\"kv_heads\": %lld, \"head_dim\": %lld, \"dtype\": \"%s\", "
                "\"bf16_tier\": \"%s\", \"block\": %lld, \"prefill\": \"%s\", "
                "\"prefill_seconds\": %.6g, \"prefill_bytes\": %llu, "
                "\"token_seconds_mean\": %.6g, \"token_seconds_median\": %.6g, "
                "\"merge_seconds_mean\": %.6g, \"decode_bytes_per_token\": %.6g, "
                "\"cache_bytes_per_rank_max\": %llu, \"cache_bytes_per_rank_min\": %llu, "
                "\"cpu_seconds_per_token\": [%s], \"outputs_hash\": \"%016llx\"}\n",
                transport.c_str(), ranks, (long long)c.cache.sequences, (long long)total,
                (long long)c.tokens, (long long)c.hq, (long long)c.cache.kv_heads,
                (long long)c.cache.head_dim, dtype_name(c.cache.dtype),
                bf16_tier_name(c.cache.kernel.bf16_tier), (long long)c.cache.block,
                r.prefill_mode.c_str(), r.prefill_seconds, (unsigned long long)r.prefill_bytes,
                mean, median(r.step_seconds),
                r.step_seconds.empty() ? 0 : r.merge_seconds / double(r.step_seconds.size()),
                c.tokens ? double(r.decode_bytes) / double(c.tokens) : 0.0,
                (unsigned long long)cmax, (unsigned long long)cmin, cpu.c_str(),
                (unsigned long long)r.outputs_hash);
    return;
  }
  std::printf("ctxpar decode: %lld sequence(s), context %lld tokens, %d ranks (%s), Hq %lld, "
              "Hkv %lld, D %lld, %s, block %lld\n",
              (long long)c.cache.sequences, (long long)total, ranks, transport.c_str(),
              (long long)c.hq, (long long)c.cache.kv_heads, (long long)c.cache.head_dim,
              dtype_label(c.cache.dtype, c.cache.kernel.bf16_tier),
              (long long)c.cache.block);
  std::printf("prefill (%s): %.3f s, %s moved\n", r.prefill_mode.c_str(), r.prefill_seconds,
              bytes_text(double(r.prefill_bytes)).c_str());
  std::printf("decode: %lld tokens, %.3f ms per token (median %.3f ms; merge %.3f ms), %s moved "
              "per token\n",
              (long long)c.tokens, mean * 1e3, median(r.step_seconds) * 1e3,
              r.step_seconds.empty() ? 0 : r.merge_seconds / double(r.step_seconds.size()) * 1e3,
              bytes_text(c.tokens ? double(r.decode_bytes) / double(c.tokens) : 0).c_str());
  std::printf("KV cache per rank: %s (max) .. %s (min)\n", bytes_text(double(cmax)).c_str(),
              bytes_text(double(cmin)).c_str());
  std::printf("decode CPU time per token, per rank (s): %s\n", cpu.c_str());
}

// --plan: the planner's predictions for this configuration, from rates measured here.
void print_plan(const DecodeConfig& c, int ranks) {
  const KvCacheOptions& o = c.cache;
  const InferenceRates rates = measure_inference_rates(o, c.hq);
  const DecodePlan d = plan_decode(o, c.hq, 1, c.context, ranks, rates);
  const int64_t longest = *std::max_element(c.context.begin(), c.context.end());
  PrefillShape sh;
  sh.new_tokens = c.chunk > 0 ? std::min(c.chunk, longest) : longest;
  sh.cached = longest - sh.new_tokens;
  sh.ranks = ranks, sh.hq = c.hq, sh.hkv = o.kv_heads, sh.head_dim = o.head_dim;
  sh.block = o.block, sh.kv_dtype = o.dtype, sh.q_dtype = o.dtype;
  const PrefillPlan p = plan_prefill(sh, o.mask.causal, rates);
  const auto [tmin, tmax] = std::minmax_element(d.tokens_per_rank.begin(), d.tokens_per_rank.end());
  const auto [bmin, bmax] = std::minmax_element(d.cache_bytes.begin(), d.cache_bytes.end());
  if (c.json) {
    std::printf("{\"command\": \"decode --plan\", \"ranks\": %d, \"rates\": {"
                "\"decode_seconds_per_token_head\": %.6g, \"attention_flops\": %.6g, "
                "\"link_bytes_per_second\": %.6g, \"message_seconds\": %.6g}, "
                "\"decode_seconds_per_token\": %.6g, \"decode_kernel_seconds\": %.6g, "
                "\"decode_merge_seconds\": %.6g, \"decode_bytes_per_token\": %llu, "
                "\"cache_bytes_per_rank_max\": %llu, \"cache_bytes_per_rank_min\": %llu, "
                "\"prefill_new_tokens\": %lld, \"prefill_cached\": %lld, "
                "\"pass_kv_bytes\": %llu, \"pass_q_bytes\": %llu, \"pass_kv_seconds\": %.6g, "
                "\"pass_q_seconds\": %.6g, \"auto\": \"%s\", \"crossover_bytes\": %lld, "
                "\"crossover_seconds\": %lld}\n",
                ranks, rates.decode_seconds_per_token_head, rates.attention_flops,
                rates.link_bytes_per_second, rates.message_seconds, d.seconds, d.kernel_seconds,
                d.merge_seconds, (unsigned long long)d.bytes_per_call,
                (unsigned long long)*bmax, (unsigned long long)*bmin,
                (long long)sh.new_tokens, (long long)sh.cached,
                (unsigned long long)p.bytes.pass_kv, (unsigned long long)p.bytes.pass_q,
                p.pass_kv_seconds, p.pass_q_seconds, prefill_mode_name(p.chosen),
                (long long)p.crossover_bytes, (long long)p.crossover_seconds);
    return;
  }
  std::printf("ctxpar decode --plan: %d ranks; rates measured here: decode %.3g ns per cached "
              "token and KV head, attention %.3g GFLOP/s, link %.3g GB/s, %.3g us per message\n",
              ranks, rates.decode_seconds_per_token_head * 1e9, rates.attention_flops * 1e-9,
              rates.link_bytes_per_second * 1e-9, rates.message_seconds * 1e6);
  std::printf("decode: %.3f ms per token (attention %.3f ms on the fullest rank + merge %.3f "
              "ms), %s moved per token (all ranks); cache per rank %s .. %s (%lld .. %lld "
              "tokens)\n",
              d.seconds * 1e3, d.kernel_seconds * 1e3, d.merge_seconds * 1e3,
              bytes_text(double(d.bytes_per_call)).c_str(), bytes_text(double(*bmax)).c_str(),
              bytes_text(double(*bmin)).c_str(), (long long)*tmax, (long long)*tmin);
  std::printf("prefill of %lld tokens onto %lld cached: pass-kv %s, %.3f s; pass-q %s, %.3f s; "
              "auto picks %s\n",
              (long long)sh.new_tokens, (long long)sh.cached,
              bytes_text(double(p.bytes.pass_kv)).c_str(), p.pass_kv_seconds,
              bytes_text(double(p.bytes.pass_q)).c_str(), p.pass_q_seconds,
              prefill_mode_name(p.chosen));
  std::printf("crossover for %lld new tokens: pass-q moves fewer bytes from %lld cached tokens "
              "on, takes less time from %lld on (-1: never)\n",
              (long long)sh.new_tokens, (long long)p.crossover_bytes,
              (long long)p.crossover_seconds);
}

// The memory this process needs, from the options alone, so that a run that cannot fit is
// refused before anything is allocated or drawn (counting the cache alone, `--heads 4096` over
// 32K tokens passed and then failed allocating a rank's 16 GiB of queries). Per rank: its shards
// in whole blocks (what reserve() allocates), and the larger of a prefill call's buffers and a
// decode step's. `ranks_here`: the ranks in this process (P on threads, 1 under a launcher).
struct DecodeMemory {
  double cache = 0, prefill = 0, decode = 0;  // this process
  double fullest_cache = 0;                   // the fullest rank's cache (--max-cache-bytes)
  double total() const { return cache + std::max(prefill, decode); }
};

DecodeMemory decode_memory(const DecodeConfig& c, int ranks, int ranks_here) {
  const KvCacheOptions& o = c.cache;
  const double p = ranks, s = double(dtype_size(o.dtype)), hq = double(c.hq),
               hkv = double(o.kv_heads), d = double(o.head_dim), b = double(o.sequences);
  DecodeMemory m;
  std::vector<int64_t> final_lengths;
  int64_t longest = 0;
  for (int64_t n : c.context) final_lengths.push_back(n + c.tokens), longest = std::max(longest, n);
  double all = 0, shard = 0;  // shard: the largest of the longest sequence (what pass-KV moves)
  for (int r = 0; r < ranks; ++r) {
    const double mine = double(kv_cache_bytes(o, final_lengths, ranks, r));
    all += mine;
    m.fullest_cache = std::max(m.fullest_cache, mine);
    shard = std::max(shard, double(kv_cache_bytes(o, {longest + c.tokens}, ranks, r)));
  }
  m.cache = ranks_here == ranks ? all : ranks_here * m.fullest_cache;
  // Rows a rank takes of one prefill call of t tokens: the blocks of its turn among the at most
  // t / block + 2 blocks the call touches.
  const int64_t t = c.chunk > 0 ? std::min(c.chunk, longest) : longest;
  const int64_t blocks = (t + o.block - 1) / o.block + 1;
  const double rows = double(std::min<int64_t>(t, (blocks + ranks - 1) / ranks * o.block));
  // Live together: the call's k, v (and q, out, lse when it attends) in --dtype, and either
  // the fp32 rows being drawn (before the call) or what the call itself holds.
  double call = 2 * rows * hkv * d * s, during = 0;
  const double drawing = rows * (c.attend ? hq : hkv) * d * 4;
  if (c.attend) {
    call += rows * hq * d * s + rows * hq * (d + 1) * 4;  // q; out, lse
    const double pass_kv = 2 * shard                        // its shard packed, one arriving
                           + rows * hq * (d + 2) * 4;       // the kernel's running state
    const double pass_q = 2 * rows * (hq * d * s + 8)       // q blocks: its own, one arriving
                          + p * rows * hq * (d + 2) * 4     // a state per block it serves
                          + (2 * p - 1) * rows * hq * (d + 1) * 4;  // partials: made, received
    // The modes the calls run: auto's choice moves from pass-KV to pass-Q as the cache grows,
    // so the first and the last call of the longest sequence say which it takes.
    PrefillShape first;
    first.new_tokens = t, first.ranks = ranks, first.hq = c.hq, first.hkv = o.kv_heads;
    first.head_dim = o.head_dim, first.block = o.block;
    first.kv_dtype = first.q_dtype = o.dtype;
    PrefillShape last = first;
    last.new_tokens = longest - (longest - 1) / t * t, last.cached = longest - last.new_tokens;
    for (const PrefillShape& sh : {first, last})
      during = std::max(during, choose_prefill(sh, c.mode) == PrefillMode::pass_q ? pass_q : pass_kv);
  }
  call += std::max(drawing, during);
  m.prefill = ranks_here * call;
  const double step = b * (hq + 2 * hkv) * d * (4 + s)  // q, k_new, v_new drawn, then in --dtype
                      + b * hq * d * s                   // q packed by KV head
                      + b * hq * (d + 1) * 4 * (p + 2)   // out, lse; the P partials; its own
                      + b * hq * (d + 2) * 4;            // the kernel's running state
  m.decode = ranks_here * step;
  return m;
}

// Refuses (exit 2) a run that needs more than --max-cache-bytes or this process's memory limit,
// naming the figures and the options that make the largest part.
void check_decode_memory(const DecodeConfig& c, int ranks, int ranks_here) {
  const DecodeMemory m = decode_memory(c, ranks, ranks_here);
  const KvCacheOptions& k = c.cache;
  if (k.max_bytes_per_rank > 0 && m.fullest_cache > k.max_bytes_per_rank)
    throw UsageError("the KV cache needs " + bytes_text(m.fullest_cache) + " on a rank, over " +
                     "--max-cache-bytes " + bytes_text(k.max_bytes_per_rank) +
                     "; raise it, use more --ranks or a shorter --context");
  const MemoryLimit limit = memory_limit();
  if (!limit.known() || m.total() <= limit.bytes) return;
  const char* fix =
      m.cache >= std::max(m.prefill, m.decode)
          ? "use a shorter --context, fewer --kv-heads, a smaller --block or --dtype bf16"
      : m.prefill >= m.decode
          ? "prefill in a smaller --chunk, with fewer --heads, or store the context without "
            "attending (--prefill fill)"
          : "use fewer --heads or a smaller --batch";
  int64_t longest = 0;
  for (int64_t n : c.context) longest = std::max(longest, n);
  const int64_t per_call = c.chunk > 0 ? std::min(c.chunk, longest) : longest;
  throw UsageError("the run " + limit.shortfall(m.total()) + " (" + std::to_string(ranks_here) +
                   " rank" + (ranks_here == 1 ? "" : "s") + " in this process: the KV cache " +
                   bytes_text(m.cache) + ", a prefill call's q, k, v, out and transfers " +
                   bytes_text(m.prefill) + " for " + std::to_string(per_call) +
                   " tokens of --heads " + std::to_string(c.hq) + ", a decode step's " +
                   bytes_text(m.decode) + "); " + fix);
}

Options decode_options() {
  Options o("decode",
            "Long-context inference with the KV cache spread over the ranks (block round-robin):\n"
            "fill each sequence's cache with a context, by prefill attention (pass-KV or pass-Q)\n"
            "or by storing its K/V alone, then decode tokens one per step; report the per-token\n"
            "latency, the bytes moved and the cache's memory per rank.");
  o.add("context", "4096", "context tokens per sequence before decoding (64K / 1M suffixes)")
      .add("lengths", "", "context tokens of each sequence, comma-separated (instead of --context)")
      .add("batch", "1", "sequences decoded together (each --context tokens long)")
      .add("tokens", "16", "tokens to decode per sequence, one per step")
      .add("ranks", "2", "ranks on the threads transport (ignored under mpirun and torchrun)")
      .add("transport", "auto",
           "auto | threads | mpi | gloo (auto: mpi under mpirun, gloo under torchrun, else "
           "threads)")
      .add("heads", "8", "query heads Hq")
      .add("kv-heads", "1", "key/value heads Hkv (divides Hq; GQA)")
      .add("head-dim", "64", "head dimension D (16..256)")
      .add("dtype", "fp32", "q, k, v and cache storage: fp32 | bf16")
      .add("bf16-tier", "exact", kBf16TierHelp)
      .add("mask", "causal", "causal | causal+window:L,0 (keys at or before the query)")
      .add("block", "64", "placement block: tokens each rank takes in turn")
      .add("prefill", "auto", "attend (prefill attention) | fill (store the K/V only) | auto "
                              "(attend up to 32K tokens per sequence)")
      .add("prefill-mode", "auto", "attend: auto | pass-kv | pass-q (auto: fewer bytes)")
      .add("chunk", "0", "attend: prefill in chunks of this many tokens (0: all at once)")
      .add("k-npy", "", "keys of the context, .npy [C, Hkv, D] or [1, C, Hkv, D] (with --v-npy)")
      .add("v-npy", "", "values of the context, the same shape as --k-npy")
      .add("max-cache-bytes", "0", "refuse a rank's cache beyond this many bytes (0: no limit)")
      .add("threads", "1", "kernel threads per rank (not given: OMP_NUM_THREADS when set)")
      .add_device()
      .add("seed", "1", "seed of the random context, queries and decoded tokens")
      .flag("json", "one JSON object on stdout")
      .flag("plan", "run nothing: predict decode's per-token time, bytes and memory per rank "
                    "and prefill's (--chunk tokens onto the rest) in both modes with the "
                    "crossover, from rates measured here (about a second)")
      .example("ctxpar decode --context 1M --ranks 8 --tokens 64 --prefill fill")
      .example("ctxpar decode --context 8192 --ranks 2 --tokens 16 --prefill-mode pass-q --chunk 1024")
      .example("mpirun -n 4 ctxpar decode --context 256K --tokens 32 --prefill fill")
      .example("torchrun --no-python --nproc-per-node 2 ctxpar decode --context 64K --tokens 8")
      .example("ctxpar decode --plan --context 131072 --chunk 4096 --ranks 2");
  return o;
}

// --lengths, else --batch sequences of --context tokens.
std::vector<int64_t> context_lengths(const Options& o) {
  std::vector<int64_t> context;
  const int64_t batch = o.i64("batch", 1, kMaxBatch);
  if (o.given("lengths")) {
    context = o.list_i64("lengths");
    if (int64_t(context.size()) > kMaxBatch)
      throw UsageError("--lengths gives " + std::to_string(context.size()) + " sequences, " +
                       "over the " + std::to_string(kMaxBatch) + " --batch takes");
    for (int64_t n : context)
      if (n < 1 || n > kMaxTokens)
        throw UsageError("--lengths: each length must be in [1, " + std::to_string(kMaxTokens) +
                         "], got " + std::to_string(n));
    if (o.given("batch") && int64_t(context.size()) != batch)
      throw UsageError("--lengths gives " + std::to_string(context.size()) +
                       " sequences but --batch is " + std::to_string(batch) + "; give one");
  } else {
    context.assign(size_t(batch), o.i64("context", 1, kMaxTokens));
  }
  return context;
}

// --k-npy / --v-npy: headers of the shape [C, Hkv, D] (or [1, C, Hkv, D]) with C >= `longest`.
void check_context_files(const DecodeConfig& c, int64_t longest) {
  const KvCacheOptions& k = c.cache;
  if (c.k_npy.empty() != c.v_npy.empty())
    throw UsageError("--k-npy and --v-npy go together: give both or neither");
  for (const auto& [option, path] : {std::pair{"k-npy", c.k_npy}, std::pair{"v-npy", c.v_npy}}) {
    if (path.empty()) continue;
    NpyHeader h;
    try {
      h = read_npy_header(path);
    } catch (const Error& e) {
      throw UsageError(std::string("--") + option + ": " + e.what());
    }
    const bool rank3 = h.shape.size() == 3, rank4 = h.shape.size() == 4 && h.shape[0] == 1;
    const int64_t tokens = rank3 ? h.shape[0] : rank4 ? h.shape[1] : 0;
    const Shape tail = rank3 ? Shape{h.shape[1], h.shape[2]}
                             : rank4 ? Shape{h.shape[2], h.shape[3]} : Shape{};
    if (!(rank3 || rank4) || tail != Shape({k.kv_heads, k.head_dim}) || tokens < longest)
      throw UsageError(std::string("--") + option + " " + path + ": expected shape [C, " +
                       std::to_string(k.kv_heads) + ", " + std::to_string(k.head_dim) +
                       "] (or [1, C, ...]) with C >= " + std::to_string(longest) +
                       " (--kv-heads, --head-dim, --context), got " + shape_str(h.shape));
  }
}

// The run a parsed command line asks for, checked (a UsageError naming the option).
DecodeConfig decode_from_options(const Options& o) {
  DecodeConfig c;
  KvCacheOptions& k = c.cache;
  c.context = context_lengths(o);
  k.sequences = int64_t(c.context.size());
  c.tokens = o.i64("tokens", 0, kMaxTokens);
  c.hq = o.i64("heads", 1, kMaxHeads);
  k.kv_heads = o.i64("kv-heads", 1, kMaxHeads);
  if (c.hq % k.kv_heads != 0)
    throw UsageError("--kv-heads " + std::to_string(k.kv_heads) + " must divide --heads " +
                     std::to_string(c.hq) + " (GQA: each KV head serves Hq / Hkv query heads)");
  k.head_dim = o.i64("head-dim", 16, 256);
  k.dtype = parse_dtype(o.str("dtype"));
  if (k.dtype != DType::f32 && k.dtype != DType::bf16)
    throw UsageError("--dtype must be fp32 or bf16, got '" + o.str("dtype") + "'");
  k.kernel.bf16_tier = bf16_tier_option(o);  // prefill's and decode's kernel calls
  k.mask = parse_mask(o.str("mask"));
  check_cache_mask(k.mask, "--mask");  // the library's rule, KvCache's and ctxpar.KVCache's
  if (k.mask.documents)
    throw UsageError("--mask with documents is not offered by the command (the library takes "
                     "document ids: ctxpar/inference.h)");
  k.block = o.i64("block", 1, int64_t{1} << 30);
  k.max_bytes_per_rank = o.num("max-cache-bytes", 0, 1e18);
  k.kernel.threads = threads_option(o);
  k.device = device_of(o);
  c.seed = uint64_t(o.i64("seed", 0, kMaxSeed));
  c.chunk = o.i64("chunk", 0, kMaxTokens);
  c.json = o.on("json");
  try {
    c.mode = parse_prefill_mode(o.str("prefill-mode"));
  } catch (const Error& e) {
    throw UsageError(std::string("--prefill-mode: ") + e.what());
  }
  const std::string how = o.str("prefill");
  if (how != "auto" && how != "attend" && how != "fill")
    throw UsageError("--prefill must be auto, attend or fill, got '" + how + "'");
  int64_t longest = 0;
  for (int64_t n : c.context) longest = std::max(longest, n);
  c.attend = how == "attend" || (how == "auto" && longest <= 32768);
  c.k_npy = o.str("k-npy"), c.v_npy = o.str("v-npy");
  check_context_files(c, longest);
  return c;
}

// Runs `c` on the ranks of `transport` (the world of a launcher's job, already joined, or
// --ranks threads): agrees the options across processes, then plans (--plan) or runs.
int run_decode(const Options& o, const DecodeConfig& c, TransportKind transport) {
  const bool one_per_process = transport_traits(transport).one_rank_per_process;
  auto world = [&]() -> Communicator& { return process_world(transport, 120); };
  const KvCacheOptions& k = c.cache;
  const int ranks = one_per_process ? world().size()
                                    : o.i32("ranks", 1, kMaxThreadsRanks, kThreadsRanksNote);
  if (one_per_process && k.device.kind != DeviceKind::cpu)
    throw UsageError("--device sim runs on the threads transport only; use --device cpu under "
                     "mpirun or torchrun");

  // Every process parsed its own command line (an MPMD mpirun line, or torchrun's copies):
  // before anything else, --plan included, refuse ranks that differ, naming the option (a rank
  // alone with --plan returned while the others waited 120 s for it, naming nothing).
  if (one_per_process) {
    Signature sig;
    for (const char* name : {"context", "lengths", "batch", "tokens", "heads", "kv-heads",
                             "head-dim", "dtype", "bf16-tier", "mask", "block", "prefill",
                             "prefill-mode", "chunk", "max-cache-bytes", "threads", "seed"})
      sig.push_back({name, o.str(name)});
    sig.push_back({"plan", o.on("plan") ? "on" : "off"});
    sig.push_back({"json", o.on("json") ? "on" : "off"});
    for (const auto& [option, path] : {std::pair{"k-npy", c.k_npy}, std::pair{"v-npy", c.v_npy}})
      sig.push_back({option, path.empty() ? "" : path + ", " + file_fingerprint(path)});
    agree_on_options(world(), sig, "decode");
  }
  const bool leader = !one_per_process || world().rank() == 0;  // prints
  if (o.on("plan")) {
    if (leader) print_plan(c, ranks);
    return 0;
  }
  // Everything the run allocates, checked before anything runs (exit 2 naming the options).
  check_decode_memory(c, ranks, one_per_process ? 1 : ranks);

  Report report;
  auto body = [&](Communicator& comm) { run_rank(comm, c, report); };
  LaunchOptions launch_options;
  launch_options.gloo = gloo_options(120);
  launch_ranks(transport, ranks, body, launch_options);  // a threads rank's failure: exit 1
  if (leader) print(c, ranks, transport_name(transport), report);
  return 0;
}

}  // namespace

int cmd_decode(int argc, char** argv) {
  Options o = decode_options();
  if (!o.parse(argc, argv)) return 0;
  // torchrun: one rank per process over gloo (an incomplete environment is refused by
  // gloo_from_torchrun_env, naming the variable); other launchers without MPI are refused
  // (each copy would run the whole job alone), as `attention` and `train` do.
  if (!torchrun_job()) refuse_foreign_launcher("decode");
  using enum TransportKind;
  const TransportKind transport = transport_option(o.str("transport"), {threads, mpi, gloo});
  if (transport == gloo && !torchrun_job())
    throw UsageError("--transport gloo needs the job started by torchrun, e.g. torchrun "
                     "--nproc-per-node 2 --no-python ctxpar decode ...; or use --transport "
                     "threads");
  // Joined first: from here on a rank's error ends every rank at once (mpirun), or within
  // seconds naming it (gloo), instead of leaving the others waiting to be joined.
  if (transport_traits(transport).one_rank_per_process) process_world(transport, 120);
  return run_decode(o, decode_from_options(o), transport);
}

}  // namespace ctxpar::cli
