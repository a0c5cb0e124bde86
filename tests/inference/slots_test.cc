// A cache a server can use (issue 39): slots (add / free / reset), decode of any subset of the
// live sequences, prefill of several prompts in one call, truncate and fork -- each against the
// fp64 reference of whole-sequence attention of what the sequence holds by then -- and every
// refused call (a free slot, a fork past its length, truncating below zero, a decode naming a
// dead sequence, ranks with other shapes or slot tables) leaving the cache as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>

#include "ctxpar/error.h"
#include "inference/inference_support.h"
#include "inference/internal.h"
#include "inference/slots_support.h"

using namespace ctxpar;
using namespace ctxpar::testing;

// A server's life on P = 1..3 ranks: two prompts of different lengths in one prefill, decode
// of both then of one, a finished request freed and its slot reused by the next, a rejected
// draft rolled back, a sample forked from a prefix, a slot reset and refilled.
TEST(KvCacheSlots, AServersCallsMatchTheReference) {
  const Pool pool;
  for (int p : {1, 2, 3}) {
    SCOPED_TRACE("P=" + std::to_string(p));
    run_threads(p, [&](Communicator& comm) {
      KvCache cache(comm, slot_options(0));
      Server s{pool, cache, {}};
      const int64_t a = cache.add(), b = cache.add();
      EXPECT_EQ(a, 0);
      EXPECT_EQ(b, 1);
      s.prefill_prompts({a, b}, {37, 70});  // one call, two lengths
      s.decode_step({a, b});
      s.decode_step({b, a}, 2);  // any order, Tn = 2
      s.decode_step({b});        // a subset: a waits
      cache.free(a);             // a finished
      EXPECT_FALSE(cache.live(a));
      EXPECT_EQ(cache.live_sequences(), std::vector<int64_t>{b});
      const int64_t c = cache.add();
      EXPECT_EQ(c, a);  // the freed slot is reused
      s.truth[c].clear();
      s.prefill_prompts({c}, {20});
      s.decode_step({b, c});
      // Speculative decoding: 3 draft tokens, 2 rejected.
      s.decode_step({b}, 3);
      cache.truncate(b, cache.tokens(b) - 2);
      s.truth[b].resize(s.truth[b].size() - 2);
      s.decode_step({b});
      // Two samples of b's first 50 tokens, and a fork of the whole of c.
      const int64_t d = cache.fork(b, 50), e = cache.fork(c);
      EXPECT_EQ(d, 2);
      EXPECT_EQ(e, 3);
      s.truth[d] = Rows(s.truth[b].begin(), s.truth[b].begin() + 50);
      s.truth[e] = s.truth[c];
      s.decode_step({d, b, e, c});
      s.decode_step({d});
      cache.reset(c);
      s.truth[c].clear();
      EXPECT_EQ(cache.tokens(c), 0);
      s.prefill_prompts({c, d}, {5, 33});
      s.decode_step({e, d, c, b});
    });
  }
}

TEST(KvCacheSlots, DecodeOfEveryLiveSequenceSkipsFreeSlots) {
  const Pool pool;
  run_threads(2, [&](Communicator& comm) {
    KvCache cache(comm, slot_options(3));
    Server s{pool, cache, {}};
    s.prefill_prompts({0, 1, 2}, {10, 40, 17});
    cache.free(1);
    Tensor q = rows_of(pool.q, {300, 301}), k = rows_of(pool.k, {300, 301}),
           v = rows_of(pool.v, {300, 301});
    // [1, 2, ...] rows as [2, 1, ...]: sequences 0 and 2, one token each.
    const TensorView qb(q.data(), DType::f32, {2, 1, kHq, kD}),
        kb(k.data(), DType::f32, {2, 1, kHkv, kD}), vb(v.data(), DType::f32, {2, 1, kHkv, kD});
    Tensor out(DType::f32, {2, 1, kHq, kD}), lse(DType::f32, {2, kHq, 1});
    decode(cache, qb, kb, vb, out, lse);
    s.truth[0].push_back(300);
    s.truth[2].push_back(301);
    for (int64_t i : {0, 1}) {
      const Rows& rows = s.truth[i == 0 ? 0 : 2];
      EXPECT_EQ(check_rows(pool, rows, {int64_t(rows.size()) - 1}, out.view().slice(0, i, i + 1),
                           lse.view().slice(0, i, i + 1)),
                "");
    }
  });
}

// ---- refused calls change nothing --------------------------------------------------------

TEST(KvCacheSlotRefusals, ASlotCallsMisuseIsRefusedAndChangesNothing) {
  auto local = [](const std::function<void(KvCache&)>& call) {
    return refused_everywhere(2, three_sequences, [&](Communicator&, KvCache& c) { call(c); });
  };
  auto freed = [](Communicator& comm, KvCache& c) {
    three_sequences(comm, c);
    c.free(1);
  };
  expect_all_contain(
      refused_everywhere(2, freed, [](Communicator&, KvCache& c) { c.free(1); }),
      "sequence 1 is free (freed, or never added): add() a sequence and use the index it returns");
  expect_all_contain(refused_everywhere(2, freed, [](Communicator&, KvCache& c) { c.fork(1); }),
                     "sequence 1 is free");
  expect_all_contain(local([](KvCache& c) { c.fork(0, 31); }),
                     "fork: sequence 0 has 30 tokens; a fork keeps at most all of them");
  // A fork of a fork past its length.
  auto forked = [](Communicator& comm, KvCache& c) {
    three_sequences(comm, c);
    EXPECT_EQ(c.fork(1, 20), 3);
  };
  expect_all_contain(
      refused_everywhere(2, forked, [](Communicator&, KvCache& c) { c.fork(3, 21); }),
      "fork: sequence 3 has 20 tokens");
  expect_all_contain(local([](KvCache& c) { c.truncate(1, -1); }),
                     "truncate: sequence 1 has 45 tokens; keep n in 0..45 of them, got -1");
  expect_all_contain(local([](KvCache& c) { c.truncate(1, 46); }), "got 46");
  expect_all_contain(local([](KvCache& c) { c.reset(7); }),
                     "sequence 7 out of range: the cache has 3 slots");
  // A fork over the limits: checked as an append would be.
  KvCacheOptions limited = slot_options(3);
  limited.max_tokens_per_rank = 60;
  expect_all_contain(refused_everywhere(
                         2, three_sequences, [](Communicator&, KvCache& c) { c.fork(1); }, limited),
                     "over KvCacheOptions::max_tokens_per_rank = 60");
}

TEST(KvCacheSlotRefusals, ABadDecodeIsRefusedOnEveryRankAndChangesNothing) {
  auto freed = [](Communicator& comm, KvCache& c) {
    three_sequences(comm, c);
    c.free(1);
  };
  expect_all_contain(refused_everywhere(2, freed,
                                        [](Communicator&, KvCache& c) {
                                          decode_of(c, {0, 1});
                                        }),
                     "decode: invalid arguments on rank 0, 1 (of 2): sequence 1 is free");
  expect_all_contain(refused_everywhere(2, three_sequences,
                                        [](Communicator&, KvCache& c) {
                                          decode_of(c, {2, 0, 2});
                                        }),
                     "seqs: sequence 2 is named twice");
  expect_all_contain(
      refused_everywhere(2, three_sequences, [](Communicator&, KvCache& c) { decode_of(c, {}); }),
      "decode: no sequence to decode");
  // Ranks with other shapes: each rank's own arguments are consistent, so only the agreement
  // sees it -- before either stores its new tokens.
  expect_all_contain(refused_everywhere(3, three_sequences,
                                        [](Communicator& comm, KvCache& c) {
                                          decode_of(c, {0, 2}, comm.rank() == 2 ? 2 : 1);
                                        }),
                     "decode: the ranks were called with different arguments: new tokens per "
                     "sequence (q.dim(1)) is 1 on rank 0 but 2 on rank 2");
  expect_all_contain(refused_everywhere(2, three_sequences,
                                        [](Communicator& comm, KvCache& c) {
                                          decode_of(c, comm.rank() == 0
                                                           ? std::vector<int64_t>{0, 2}
                                                           : std::vector<int64_t>{2, 0});
                                        }),
                     "seqs (the sequences decoded) is 0,2 on rank 0 but 2,0 on rank 1");
  // A slot call made on one rank only: the slot tables differ.
  expect_all_contain(refused_everywhere(
                         2,
                         [](Communicator& comm, KvCache& c) {
                           three_sequences(comm, c);
                           if (comm.rank() == 1) c.truncate(1, 40);
                         },
                         [](Communicator&, KvCache& c) { decode_of(c, {0}); }),
                     "slot table (live slots and their lengths) is 3 slots, ");
}

// KvCacheOptions::hash_inputs: ranks passing different queries were merged without a word.
TEST(KvCacheSlotRefusals, RanksWithOtherQueriesAreRefusedWhenInputsAreHashed) {
  KvCacheOptions o = slot_options(3);
  o.hash_inputs = true;
  expect_all_contain(refused_everywhere(
                         2, three_sequences,
                         [](Communicator& comm, KvCache& c) {
                           decode_of(c, {0, 1}, 1, comm.rank() == 1 ? 9 : 7);
                         },
                         o),
                     "q, k_new, v_new (a hash of their values) is ");
  o.hash_inputs = false;  // off: the ranks' partials merge (the cost is a pass over the inputs)
  run_threads(2, [&](Communicator& comm) {
    KvCache c(comm, o);
    three_sequences(comm, c);
    decode_of(c, {0, 1}, 1, comm.rank() == 1 ? 9 : 7);
    EXPECT_EQ(c.tokens(0), 31);
  });
}

TEST(KvCacheSlotRefusals, ABadPromptRefusesTheWholePrefillAndChangesNothing) {
  // Request 1 of 2 has a NaN key on the rank that holds its token 5; request 0 is good.
  auto call = [](int64_t seq1, bool nan) {
    return [=](Communicator& comm, KvCache& c) {
      Prompts prompts;
      const int64_t seqs[2] = {0, seq1}, lengths[2] = {20, 9};
      for (int i = 0; i < 2; ++i) {
        const int64_t first = c.live(seqs[i]) ? c.tokens(seqs[i]) : 0;
        const int64_t tl = int64_t(c.placement(first, lengths[i], comm.rank()).size());
        Tensor k = normal({1, tl, kHkv, kD}, 3 + i);
        if (i == 1 && nan && tl > 5) k.ptr<float>()[5 * kHkv * kD] = std::nanf("");
        prompts.add(seqs[i], lengths[i], normal({1, tl, kHq, kD}, 1 + i), std::move(k),
                    normal({1, tl, kHkv, kD}, 5 + i));
      }
      prompts.run(c);
    };
  };
  // 45 cached tokens: 45..53 are rank 0's (block 16, rows 45..47) then rank 1's (48..53): row 5
  // of request 1 is rank 1's token 53.
  expect_all_contain(refused_everywhere(2, three_sequences, call(1, true)),
                     "prefill: invalid arguments on rank 1 (of 2): request 1 (seq 1): k: "
                     "non-finite value (nan) in sequence 1, token 53");
  expect_all_contain(refused_everywhere(2, three_sequences, call(0, false)),
                     "request 1 (seq 0): prefill: sequence 0 has two requests in one call");
  auto freed = [](Communicator& comm, KvCache& c) {
    three_sequences(comm, c);
    c.free(2);
  };
  expect_all_contain(refused_everywhere(2, freed, call(2, false)),
                     "request 1 (seq 2): sequence 2 is free");
}
