// The inference planner: decode's per-token time, bytes and memory per rank, and prefill's
// bytes and time in both modes with the crossover context length, from a few measured rates.
// See docs/inference.md, "Planning".
#include <algorithm>
#include <chrono>
#include <cmath>

#include "ctxpar/error.h"
#include "inference/internal.h"

namespace ctxpar {
namespace {

double link_seconds(const InferenceRates& r, double bytes) {
  if (bytes <= 0) return 0;
  return r.message_seconds + (r.link_bytes_per_second > 0 ? bytes / r.link_bytes_per_second : 0);
}

// Visible (query, key) pairs of rank `rank`'s new rows: rows at positions in [cached, cached
// + T) that the placement gives it, each seeing pos + 1 keys (causal) or all cached + T.
double rank_pairs(const PrefillShape& s, int rank, bool causal) {
  double pairs = 0;
  const int64_t end = s.cached + s.new_tokens;
  for (int64_t b = s.cached / s.block; b * s.block < end; ++b) {
    if (b % s.ranks != rank) continue;
    const int64_t lo = std::max(b * s.block, s.cached), hi = std::min((b + 1) * s.block, end);
    const double n = double(hi - lo);
    pairs += causal ? n * (double(lo) + double(hi + 1)) / 2 : n * double(end);
  }
  return pairs;
}

struct ModeSeconds {
  double pass_kv = 0, pass_q = 0;
};

ModeSeconds prefill_seconds(const PrefillShape& s, bool causal, const InferenceRates& r) {
  ModeSeconds t;
  const double flop_per_pair = 4.0 * double(s.hq * s.head_dim);
  const size_t kv_tok =
      2 * size_t(s.hkv * s.head_dim) * dtype_size(s.kv_dtype) + 8 + (s.documents ? 4 : 0);
  const size_t q_tok =
      size_t(s.hq * s.head_dim) * dtype_size(s.q_dtype) + 8 + (s.documents ? 4 : 0);
  const size_t part_tok = size_t(s.hq * (s.head_dim + 1)) * 4;
  const int p = s.ranks;
  for (int rank = 0; rank < p; ++rank) {
    const double compute =
        r.attention_flops > 0 ? rank_pairs(s, rank, causal) * flop_per_pair / r.attention_flops : 0;
    double kv = compute, q = compute;
    const double step = compute / p;
    for (int j = 1; j < p; ++j) {  // the block arriving at step j came from rank - j
      const int from = (rank - j + p) % p;
      const int64_t n = placement_held_by(s.cached + s.new_tokens, from, p, s.block);
      const int64_t rows = n - placement_held_by(s.cached, from, p, s.block);
      kv += std::max(0.0, link_seconds(r, double(n) * double(kv_tok)) - step);
      q += std::max(0.0, link_seconds(r, double(rows) * double(q_tok)) - step);
    }
    const int64_t mine = placement_held_by(s.cached + s.new_tokens, rank, p, s.block) -
                         placement_held_by(s.cached, rank, p, s.block);
    if (mine > 0) q += (p - 1) * link_seconds(r, double(mine) * double(part_tok));
    t.pass_kv = std::max(t.pass_kv, kv);
    t.pass_q = std::max(t.pass_q, q);
  }
  return t;
}

// The least cached length in [0, 2^40] where `q_wins(cached)` holds, assuming it holds from
// some length on (pass-KV's cost grows with the cache, pass-Q's hardly does); -1 if never.
template <typename Wins>
int64_t least_cached(const PrefillShape& shape, Wins&& q_wins) {
  PrefillShape s = shape;
  auto at = [&](int64_t c) {
    s.cached = c;
    return q_wins(s);
  };
  if (at(0)) return 0;
  int64_t lo = 0, hi = std::max<int64_t>(1, shape.block);  // !at(lo)
  while (!at(hi)) {
    if (hi >= (int64_t{1} << 40)) return -1;
    lo = hi;
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (at(mid) ? hi : lo) = mid;
  }
  return hi;
}

}  // namespace

DecodePlan plan_decode(const KvCacheOptions& o, int64_t hq, int64_t tn,
                       const std::vector<int64_t>& lengths, int ranks,
                       const InferenceRates& rates) {
  CTXPAR_CHECK(ranks >= 1 && tn >= 1 && int64_t(lengths.size()) == o.sequences,
               "plan_decode: ranks, tn >= 1 and one length per sequence");
  DecodePlan plan;
  std::vector<int64_t> after;
  for (int64_t n : lengths) after.push_back(n + tn);
  for (int r = 0; r < ranks; ++r) {
    int64_t tokens = 0;
    for (int64_t n : after) tokens += placement_held_by(n, r, ranks, o.block);
    plan.tokens_per_rank.push_back(tokens);
    plan.cache_bytes.push_back(kv_cache_bytes(o, after, ranks, r));
    // g query rows of each of the tn tokens ride one stream of the shard (decode.cc's Note).
    plan.kernel_seconds =
        std::max(plan.kernel_seconds, double(tokens) * double(o.kv_heads) * double(tn) *
                                          rates.decode_seconds_per_token_head);
  }
  // The partials only: the agreement before them (agreement.h: a fixed verdict per rank) is
  // not in the call's counters, as for every collective call of the library.
  const uint64_t part = uint64_t(o.sequences * tn * hq * (o.head_dim + 1)) * 4;
  plan.bytes_per_call = uint64_t(ranks) * uint64_t(ranks - 1) * part;
  if (ranks > 1) plan.merge_seconds = (ranks - 1) * link_seconds(rates, double(part));
  plan.seconds = plan.kernel_seconds + plan.merge_seconds;
  return plan;
}

PrefillPlan plan_prefill(const PrefillShape& shape, bool causal, const InferenceRates& rates) {
  PrefillPlan plan;
  plan.bytes = predict_prefill_bytes(shape);
  plan.chosen = choose_prefill(shape);
  const ModeSeconds t = prefill_seconds(shape, causal, rates);
  plan.pass_kv_seconds = t.pass_kv, plan.pass_q_seconds = t.pass_q;
  plan.crossover_bytes = least_cached(shape, [](const PrefillShape& s) {
    const PrefillBytes b = predict_prefill_bytes(s);
    return b.pass_q < b.pass_kv;
  });
  plan.crossover_seconds = least_cached(shape, [&](const PrefillShape& s) {
    const ModeSeconds m = prefill_seconds(s, causal, rates);
    return m.pass_q < m.pass_kv;
  });
  return plan;
}

InferenceRates measure_inference_rates(const KvCacheOptions& options, int64_t hq) {
  InferenceRates rates;
  KvCacheOptions o = options;
  o.sequences = 1;
  o.mask = Mask::causal_mask();
  o.max_tokens_per_rank = 0, o.max_bytes_per_rank = 0;
  const int64_t d = o.head_dim, hkv = o.kv_heads, context = 8192, t = 512, steps = 4;
  run_threads(1, [&](Communicator& comm) {  // one rank: the kernels' rates
    KvCache cache(comm, o);
    cache.reserve({context + steps});
    Tensor k(o.dtype, {1, context, hkv, d}), v(o.dtype, {1, context, hkv, d});
    fill_normal(k, 1), fill_normal(v, 2);
    Tensor q(o.dtype, {1, t, hq, d}), out(DType::f32, {1, t, hq, d}), lse(DType::f32, {1, hq, t});
    fill_normal(q, 3);
    // The rate of a prefill onto a cache (t new rows against context - t cached keys and
    // themselves), the shape it predicts: a prefill onto an empty cache (t x t, causal) runs well
    // below that rate -- its diagonal tiles and short rows -- and predictions from it came out far
    // above the measured times (docs/BENCHMARKS.md, "Inference", has the figures).
    const int64_t cached = context - t;
    cache.append(0, k.view().slice(1, 0, cached), v.view().slice(1, 0, cached));
    prefill(cache, 0, t, q, k.view().slice(1, cached, context), v.view().slice(1, cached, context),
            out, lse, PrefillMode::pass_kv);
    const InferenceStats& st = cache.last_stats();
    const double flops =
        4.0 * double(hq * d) * (double(t) * double(cached) + double(t) * double(t + 1) / 2);
    rates.attention_flops = flops / std::max(st.attention_seconds, 1e-9);
    Tensor q1(o.dtype, {1, 1, hq, d}), k1(o.dtype, {1, 1, hkv, d}), o1(DType::f32, {1, 1, hq, d}),
        l1(DType::f32, {1, hq, 1});
    fill_normal(q1, 4), fill_normal(k1, 5);
    std::vector<double> per;
    for (int64_t s = 0; s < steps; ++s) {
      decode(cache, q1, k1, k1, o1, l1);
      per.push_back(cache.last_stats().attention_seconds);
    }
    std::sort(per.begin(), per.end());
    rates.decode_seconds_per_token_head = per[per.size() / 2] / double(context * hkv);
  });
  run_threads(2, [&](Communicator& comm) {  // two ranks: all-gathers of 64 B and of 8 MiB
    std::vector<std::byte> small(64), big(size_t(8) << 20), in(2 * big.size());
    auto timed = [&](std::vector<std::byte>& m, int reps) {
      comm.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      for (int i = 0; i < reps; ++i) comm.allgather(m.data(), in.data(), m.size());
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / reps;
    };
    const double t_small = timed(small, 50), t_big = timed(big, 4);
    if (comm.rank() == 0) {
      rates.message_seconds = t_small;
      rates.link_bytes_per_second = double(big.size()) / std::max(t_big - t_small, 1e-9);
    }
  });
  return rates;
}

}  // namespace ctxpar
