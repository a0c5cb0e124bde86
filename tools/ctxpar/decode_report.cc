// `ctxpar decode`'s report: the run's table or JSON, --plan's prediction, and the memory check
// made before anything runs (decode_job.h).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "attention_job.h"
#include "decode_job.h"
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

namespace ctxpar::cli::decode_cli {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
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
    const double pass_kv = 2 * shard                      // its shard packed, one arriving
                           + rows * hq * (d + 2) * 4;     // the kernel's running state
    const double pass_q = 2 * rows * (hq * d * s + 8)     // q blocks: its own, one arriving
                          + p * rows * hq * (d + 2) * 4   // a state per block it serves
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
      during =
          std::max(during, choose_prefill(sh, c.mode) == PrefillMode::pass_q ? pass_q : pass_kv);
  }
  call += std::max(drawing, during);
  m.prefill = ranks_here * call;
  const double step = b * (hq + 2 * hkv) * d * (4 + s)  // q, k_new, v_new drawn, then in --dtype
                      + b * hq * d * s                  // q packed by KV head
                      + b * hq * (d + 1) * 4 * (p + 2)  // out, lse; the P partials; its own
                      + b * hq * (d + 2) * 4;           // the kernel's running state
  m.decode = ranks_here * step;
  return m;
}

}  // namespace

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
    std::printf(
        "{\"command\": \"decode\", \"transport\": \"%s\", \"ranks\": %d, \"sequences\": %lld, "
        "\"context_tokens\": %lld, \"decoded_tokens\": %lld, \"heads\": %lld, "
        "\"kv_heads\": %lld, \"head_dim\": %lld, \"dtype\": \"%s\", "
        "\"bf16_tier\": \"%s\", \"block\": %lld, \"prefill\": \"%s\", "
        "\"prefill_seconds\": %.6g, \"prefill_bytes\": %llu, "
        "\"token_seconds_mean\": %.6g, \"token_seconds_median\": %.6g, "
        "\"merge_seconds_mean\": %.6g, \"decode_bytes_per_token\": %.6g, "
        "\"cache_bytes_per_rank_max\": %llu, \"cache_bytes_per_rank_min\": %llu, "
        "\"cpu_seconds_per_token\": [%s], \"merge\": \"%s\", \"merge_seconds_measured\": "
        "{\"allgather\": %.6g, \"chain\": %.6g, \"tree\": %.6g}, "
        "\"outputs_hash\": \"%016llx\"}\n",
        transport.c_str(), ranks, (long long)c.cache.sequences, (long long)total,
        (long long)c.tokens, (long long)c.hq, (long long)c.cache.kv_heads,
        (long long)c.cache.head_dim, dtype_name(c.cache.dtype),
        bf16_tier_name(c.cache.kernel.bf16_tier), (long long)c.cache.block, r.prefill_mode.c_str(),
        r.prefill_seconds, (unsigned long long)r.prefill_bytes, mean, median(r.step_seconds),
        r.step_seconds.empty() ? 0 : r.merge_seconds / double(r.step_seconds.size()),
        c.tokens ? double(r.decode_bytes) / double(c.tokens) : 0.0, (unsigned long long)cmax,
        (unsigned long long)cmin, cpu.c_str(), decode_merge_name(r.merge), r.merge_times.allgather,
        r.merge_times.chain, r.merge_times.tree, (unsigned long long)r.outputs_hash);
    return;
  }
  std::printf(
      "ctxpar decode: %lld sequence(s), context %lld tokens, %d ranks (%s), Hq %lld, "
      "Hkv %lld, D %lld, %s, block %lld\n",
      (long long)c.cache.sequences, (long long)total, ranks, transport.c_str(), (long long)c.hq,
      (long long)c.cache.kv_heads, (long long)c.cache.head_dim,
      dtype_label(c.cache.dtype, c.cache.kernel.bf16_tier), (long long)c.cache.block);
  std::printf("prefill (%s): %.3f s, %s moved\n", r.prefill_mode.c_str(), r.prefill_seconds,
              bytes_text(double(r.prefill_bytes)).c_str());
  std::printf(
      "decode: %lld tokens, %.3f ms per token (median %.3f ms; merge %.3f ms), %s moved "
      "per token\n",
      (long long)c.tokens, mean * 1e3, median(r.step_seconds) * 1e3,
      r.step_seconds.empty() ? 0 : r.merge_seconds / double(r.step_seconds.size()) * 1e3,
      bytes_text(c.tokens ? double(r.decode_bytes) / double(c.tokens) : 0).c_str());
  if (r.merge_times.allgather > 0)
    std::printf("merge: %s (timed here: allgather %.1f us, chain %.1f us, tree %.1f us)\n",
                decode_merge_name(r.merge), r.merge_times.allgather * 1e6,
                r.merge_times.chain * 1e6, r.merge_times.tree * 1e6);
  else
    std::printf("merge: %s\n", decode_merge_name(r.merge));
  std::printf("KV cache per rank: %s (max) .. %s (min)\n", bytes_text(double(cmax)).c_str(),
              bytes_text(double(cmin)).c_str());
  std::printf("decode CPU time per token, per rank (s): %s\n", cpu.c_str());
}

// --plan: the planner's predictions for this configuration, from rates measured here.
void print_plan(const DecodeConfig& c, int ranks) {
  const KvCacheOptions& o = c.cache;
  const InferenceRates rates = measure_inference_rates(o, c.hq);
  const DecodePlan d = plan_decode(o, c.hq, 1, c.context, ranks, rates);
  // The merges timed on `ranks` threads here (under mpirun / torchrun, run without --plan:
  // --merge auto times them on the job's own ranks).
  DecodeMergeTimes merges;
  if (ranks > 1)
    run_threads(ranks, [&](Communicator& comm) {
      const DecodeMergeTimes t = time_decode_merges(comm, o, c.hq, 1, 20);
      if (comm.rank() == 0) merges = t;
    });
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
    std::printf(
        "{\"command\": \"decode --plan\", \"ranks\": %d, \"rates\": {"
        "\"decode_seconds_per_token_head\": %.6g, \"attention_flops\": %.6g, "
        "\"link_bytes_per_second\": %.6g, \"message_seconds\": %.6g}, "
        "\"decode_seconds_per_token\": %.6g, \"decode_kernel_seconds\": %.6g, "
        "\"decode_merge_seconds\": %.6g, \"decode_bytes_per_token\": %llu, "
        "\"cache_bytes_per_rank_max\": %llu, \"cache_bytes_per_rank_min\": %llu, "
        "\"prefill_new_tokens\": %lld, \"prefill_cached\": %lld, "
        "\"pass_kv_bytes\": %llu, \"pass_q_bytes\": %llu, \"pass_kv_seconds\": %.6g, "
        "\"pass_q_seconds\": %.6g, \"auto\": \"%s\", \"crossover_bytes\": %lld, "
        "\"crossover_seconds\": %lld, \"merge_seconds_threads\": {\"allgather\": %.6g, "
        "\"chain\": %.6g, \"tree\": %.6g}, \"merge_fastest\": \"%s\"}\n",
        ranks, rates.decode_seconds_per_token_head, rates.attention_flops,
        rates.link_bytes_per_second, rates.message_seconds, d.seconds, d.kernel_seconds,
        d.merge_seconds, (unsigned long long)d.bytes_per_call, (unsigned long long)*bmax,
        (unsigned long long)*bmin, (long long)sh.new_tokens, (long long)sh.cached,
        (unsigned long long)p.bytes.pass_kv, (unsigned long long)p.bytes.pass_q, p.pass_kv_seconds,
        p.pass_q_seconds, prefill_mode_name(p.chosen), (long long)p.crossover_bytes,
        (long long)p.crossover_seconds, merges.allgather, merges.chain, merges.tree,
        decode_merge_name(merges.fastest_any));
    return;
  }
  std::printf(
      "ctxpar decode --plan: %d ranks; rates measured here: decode %.3g ns per cached "
      "token and KV head, attention %.3g GFLOP/s, link %.3g GB/s, %.3g us per message\n",
      ranks, rates.decode_seconds_per_token_head * 1e9, rates.attention_flops * 1e-9,
      rates.link_bytes_per_second * 1e-9, rates.message_seconds * 1e6);
  std::printf(
      "decode: %.3f ms per token (attention %.3f ms on the fullest rank + merge %.3f "
      "ms), %s moved per token (all ranks); cache per rank %s .. %s (%lld .. %lld "
      "tokens)\n",
      d.seconds * 1e3, d.kernel_seconds * 1e3, d.merge_seconds * 1e3,
      bytes_text(double(d.bytes_per_call)).c_str(), bytes_text(double(*bmax)).c_str(),
      bytes_text(double(*bmin)).c_str(), (long long)*tmax, (long long)*tmin);
  std::printf(
      "prefill of %lld tokens onto %lld cached: pass-kv %s, %.3f s; pass-q %s, %.3f s; "
      "auto picks %s\n",
      (long long)sh.new_tokens, (long long)sh.cached, bytes_text(double(p.bytes.pass_kv)).c_str(),
      p.pass_kv_seconds, bytes_text(double(p.bytes.pass_q)).c_str(), p.pass_q_seconds,
      prefill_mode_name(p.chosen));
  if (ranks > 1)
    std::printf(
        "merge of the partials, timed on %d threads here: allgather %.1f us, chain %.1f us, "
        "tree %.1f us; fastest %s; --merge auto takes the faster of allgather and chain "
        "(the same bits), timed on the job's ranks (here: %s); the tree only when asked\n",
        ranks, merges.allgather * 1e6, merges.chain * 1e6, merges.tree * 1e6,
        decode_merge_name(merges.fastest_any), decode_merge_name(merges.fastest));
  std::printf(
      "crossover for %lld new tokens: pass-q moves fewer bytes from %lld cached tokens "
      "on, takes less time from %lld on (-1: never)\n",
      (long long)sh.new_tokens, (long long)p.crossover_bytes, (long long)p.crossover_seconds);
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

}  // namespace ctxpar::cli::decode_cli
