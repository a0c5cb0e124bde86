// The inference planner (src/inference/plan.cc): its byte counts against predict_prefill_bytes
// and the communicators' counters, its crossover against a scan of the byte prediction, its
// memory against the cache's own report, and its time model's shape.
#include <gtest/gtest.h>

#include "ctxpar/error.h"
#include "inference/inference_support.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

PrefillShape shape(int64_t cached, int64_t t, int p) {
  PrefillShape s;
  s.cached = cached, s.new_tokens = t, s.ranks = p, s.hq = 8, s.hkv = 2, s.head_dim = 64;
  s.block = 64;
  return s;
}

InferenceRates rates() {
  InferenceRates r;
  r.decode_seconds_per_token_head = 1e-9;
  r.attention_flops = 1e10;
  r.link_bytes_per_second = 1e9;
  r.message_seconds = 1e-5;
  return r;
}

}  // namespace

TEST(InferencePlan, CrossoverIsTheFirstCacheLengthWherePassQMovesFewerBytes) {
  for (int p : {2, 3, 4})
    for (int64_t t : {1, 40, 512, 4096}) {
      const PrefillPlan plan = plan_prefill(shape(0, t, p), true, rates());
      EXPECT_EQ(plan.bytes.pass_kv, predict_prefill_bytes(shape(0, t, p)).pass_kv);
      // Scan: the least C with pass-Q < pass-KV, and it stays so a while after.
      int64_t scanned = -1;
      for (int64_t c = 0; c < 200000 && scanned < 0; ++c) {
        const PrefillBytes b = predict_prefill_bytes(shape(c, t, p));
        if (b.pass_q < b.pass_kv) scanned = c;
      }
      ASSERT_GE(scanned, 0) << "P=" << p << " T=" << t;
      EXPECT_EQ(plan.crossover_bytes, scanned) << "P=" << p << " T=" << t;
      for (int64_t c = scanned; c < scanned + 300; ++c) {
        const PrefillBytes b = predict_prefill_bytes(shape(c, t, p));
        EXPECT_LT(b.pass_q, b.pass_kv) << "C=" << c;
        EXPECT_EQ(choose_prefill(shape(c, t, p)), PrefillMode::pass_q);
      }
    }
}

TEST(InferencePlan, TimeModelChargesWhatEachModeCannotHide) {
  // A slow link: pass-KV's whole-cache hops cannot hide behind the compute of a short
  // prefill, so pass-Q is faster at a long cache; with no cache pass-KV is (pass-Q's partials
  // go home after the ring).
  InferenceRates slow = rates();
  slow.link_bytes_per_second = 1e7;
  const PrefillPlan long_cache = plan_prefill(shape(1 << 17, 512, 2), true, slow);
  EXPECT_LT(long_cache.pass_q_seconds, long_cache.pass_kv_seconds);
  const PrefillPlan none = plan_prefill(shape(0, 512, 2), true, slow);
  EXPECT_LT(none.pass_kv_seconds, none.pass_q_seconds);
  ASSERT_GT(none.crossover_seconds, 0);
  // At the time crossover pass-Q is faster, one token before it is not.
  const PrefillPlan at = plan_prefill(shape(none.crossover_seconds, 512, 2), true, slow);
  const PrefillPlan before = plan_prefill(shape(none.crossover_seconds - 1, 512, 2), true, slow);
  EXPECT_LT(at.pass_q_seconds, at.pass_kv_seconds);
  EXPECT_GE(before.pass_q_seconds, before.pass_kv_seconds);
  // A long prefill's compute hides even the slow link's hops: pass-Q is never faster.
  EXPECT_EQ(plan_prefill(shape(0, 4096, 2), true, slow).crossover_seconds, -1);
  // One rank: nothing moves, both modes are the compute alone.
  const PrefillPlan one = plan_prefill(shape(1000, 100, 1), true, slow);
  EXPECT_EQ(one.bytes.pass_kv, 0u);
  EXPECT_DOUBLE_EQ(one.pass_kv_seconds, one.pass_q_seconds);
  EXPECT_DOUBLE_EQ(one.pass_kv_seconds, 4.0 * 8 * 64 * (100.0 * (1001 + 1100) / 2) / 1e10);
}

TEST(InferencePlan, DecodeBytesAndMemoryAreWhatTheRanksCountAndHold) {
  for (int p : {1, 2, 3}) {
    Scenario s;
    s.prefill = {150, 77};  // two sequences of different lengths
    s.decode_steps = 1;
    s.build();
    KvCacheOptions o = s.cache_options();
    const DecodePlan plan = plan_decode(o, s.hq, 1, s.prefill, p, rates());
    std::vector<uint64_t> sent(static_cast<size_t>(p)), held(static_cast<size_t>(p));
    std::vector<int64_t> tokens(static_cast<size_t>(p));
    run_threads(p, [&](Communicator& comm) {
      KvCache cache(comm, o);
      for (int64_t b = 0; b < 2; ++b)
        cache.append(b, s.k[b].view().slice(1, 0, s.prefill[b]),
                     s.v[b].view().slice(1, 0, s.prefill[b]));
      Tensor q(DType::f32, {2, 1, s.hq, s.d}), k(DType::f32, {2, 1, s.hkv, s.d});
      Tensor out(DType::f32, {2, 1, s.hq, s.d}), lse(DType::f32, {2, s.hq, 1});
      fill_normal(q, 1), fill_normal(k, 2);
      cache.reserve({151, 78});  // whole blocks, no spare: what kv_cache_bytes counts
      decode(cache, q, k, k, out, lse);
      sent[comm.rank()] = cache.last_stats().bytes_sent;
      held[comm.rank()] = cache.bytes();
      tokens[comm.rank()] = cache.local_tokens(0) + cache.local_tokens(1);
    });
    uint64_t total = 0;
    for (int r = 0; r < p; ++r) {
      total += sent[r];
      EXPECT_EQ(plan.cache_bytes[r], held[r]) << "P=" << p << " rank " << r;
      EXPECT_EQ(plan.tokens_per_rank[r], tokens[r]) << "P=" << p << " rank " << r;
    }
    EXPECT_EQ(plan.bytes_per_call, total) << "P=" << p;
    EXPECT_EQ(plan.merge_seconds > 0, p > 1);
  }
}

TEST(InferencePlan, RatesMeasuredHereArePositive) {
  KvCacheOptions o;
  o.head_dim = 32;
  o.kv_heads = 1;
  const InferenceRates r = measure_inference_rates(o, 4);
  EXPECT_GT(r.decode_seconds_per_token_head, 0);
  EXPECT_GT(r.attention_flops, 0);
  EXPECT_GT(r.link_bytes_per_second, 0);
  EXPECT_GT(r.message_seconds, 0);
}
