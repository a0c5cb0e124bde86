// A cache a server can use (issue 39): slots (add / free / reset), decode of any subset of the
// live sequences, prefill of several prompts in one call, truncate and fork -- each against the
// fp64 reference of whole-sequence attention of what the sequence holds by then -- and every
// refused call (a free slot, a fork past its length, truncating below zero, a decode naming a
// dead sequence, ranks with other shapes or slot tables) leaving the cache as it was.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <map>

#include "ctxpar/error.h"
#include "inference/inference_support.h"
#include "inference/internal.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

constexpr int64_t kHq = 4, kHkv = 2, kD = 16, kPool = 400;

KvCacheOptions slot_options(int64_t sequences) {
  KvCacheOptions o;
  o.sequences = sequences;
  o.kv_heads = kHkv;
  o.head_dim = kD;
  o.block = 16;
  return o;
}

Tensor normal(Shape shape, uint64_t seed) {
  Tensor t(DType::f32, shape);
  fill_normal(t, seed);
  return t;
}

// Every token's q, k, v is a row of a pool; a sequence is the list of its rows (what it holds
// after add, prefill, decode, truncate and fork, kept by the test beside the cache).
struct Pool {
  Tensor q = normal({1, kPool, kHq, kD}, 11), k = normal({1, kPool, kHkv, kD}, 12),
         v = normal({1, kPool, kHkv, kD}, 13);
};
using Rows = std::vector<int64_t>;

// The requests of one prefill call, from this rank's rows q, k, v of each prompt, with their
// outputs; the tensors live here until the call returns.
struct Prompts {
  std::vector<Tensor> keep;  // q, k, v, out, lse of each request
  std::vector<std::pair<int64_t, int64_t>> seq_count;
  void add(int64_t seq, int64_t count, Tensor q, Tensor k, Tensor v) {
    const int64_t tl = q.dim(1);
    for (Tensor* t : {&q, &k, &v}) keep.push_back(std::move(*t));
    keep.emplace_back(DType::f32, Shape{1, tl, kHq, kD});
    keep.emplace_back(DType::f32, Shape{1, kHq, tl});
    seq_count.push_back({seq, count});
  }
  const Tensor& out(size_t i) const { return keep[i * 5 + 3]; }
  const Tensor& lse(size_t i) const { return keep[i * 5 + 4]; }
  void run(KvCache& cache) {
    std::vector<PrefillRequest> requests;
    for (size_t i = 0; i < seq_count.size(); ++i) {
      const Tensor* t = &keep[i * 5];
      requests.push_back({seq_count[i].first,
                          seq_count[i].second,
                          t[0].view(),
                          t[1].view(),
                          t[2].view(),
                          t[3].view(),
                          t[4].view(),
                          {}});
    }
    prefill(cache, requests);
  }
};

// Rows `at` of out [1, m, Hq, D] / lse [1, Hq, m] against the fp64 reference of the whole
// sequence `rows` (causal, positions 0..n-1), by the accuracy rule; "" when they pass.
std::string check_rows(const Pool& pool, const Rows& rows, const std::vector<int64_t>& at,
                       const TensorView& out, const TensorView& lse) {
  const Tensor q = rows_of(pool.q, rows), k = rows_of(pool.k, rows), v = rows_of(pool.v, rows);
  const int64_t n = int64_t(rows.size());
  std::vector<int64_t> pos(static_cast<size_t>(n));
  for (int64_t t = 0; t < n; ++t) pos[t] = t;
  const Tokens tok{pos, {}};
  const Mask causal = Mask::causal_mask();
  const auto ref = reference::attention_f64(q, tok, k, v, tok, causal);
  const auto naive = reference::attention_naive_f32(q, tok, k, v, tok, causal);
  double naive_o = 0, naive_l = 0, max_o = 0, max_l = 0, err_o = 0, err_l = 0;
  for (size_t i = 0; i < ref.o.size(); ++i) {
    naive_o = std::max(naive_o, std::abs(double(float(naive.o[i])) - ref.o[i]));
    max_o = std::max(max_o, std::abs(ref.o[i]));
  }
  for (size_t i = 0; i < ref.lse.size(); ++i) {
    naive_l = std::max(naive_l, std::abs(double(float(naive.lse[i])) - ref.lse[i]));
    max_l = std::max(max_l, std::abs(ref.lse[i]));
  }
  const Tensor o = Tensor::copy_of(out), l = Tensor::copy_of(lse);
  const int64_t m = int64_t(at.size()), hd = kHq * kD;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < hd; ++j)  // ref.o [1, n, Hq, D]
      err_o = std::max(err_o, std::abs(double(o.ptr<float>()[i * hd + j]) - ref.o[at[i] * hd + j]));
    for (int64_t h = 0; h < kHq; ++h)  // ref.lse [1, Hq, n]
      err_l = std::max(err_l, std::abs(double(l.ptr<float>()[h * m + i]) - ref.lse[h * n + at[i]]));
  }
  std::string why;
  if (!(err_o <= reference::accuracy_tolerance(naive_o, max_o)))
    why += "out error " + std::to_string(err_o) + "; ";
  if (!(err_l <= reference::accuracy_tolerance(naive_l, max_l)))
    why += "lse error " + std::to_string(err_l) + "; ";
  return why;
}

// The server's side of one rank: the cache and, per slot, the rows it should hold.
struct Server {
  const Pool& pool;
  KvCache& cache;
  std::map<int64_t, Rows> truth;
  int64_t next = 0;  // the next unused pool row

  Rows fresh(int64_t n) {
    Rows r;
    for (int64_t i = 0; i < n; ++i) r.push_back(next++ % kPool);
    return r;
  }

  // One prefill call with a prompt of lengths[i] new tokens for each of seqs; each rank checks
  // the rows it computed.
  void prefill_prompts(const std::vector<int64_t>& seqs, const std::vector<int64_t>& lengths) {
    const int me = cache.comm().rank();
    Prompts prompts;
    std::vector<std::vector<int64_t>> at;
    for (size_t i = 0; i < seqs.size(); ++i) {
      const Rows added = fresh(lengths[i]);
      const int64_t first = int64_t(truth[seqs[i]].size());
      at.push_back(cache.placement(first, lengths[i], me));
      Rows mine;
      for (int64_t t : at.back()) mine.push_back(added[t - first]);
      prompts.add(seqs[i], lengths[i], rows_of(pool.q, mine), rows_of(pool.k, mine),
                  rows_of(pool.v, mine));
      truth[seqs[i]].insert(truth[seqs[i]].end(), added.begin(), added.end());
    }
    prompts.run(cache);
    for (size_t i = 0; i < seqs.size(); ++i)
      EXPECT_EQ(check_rows(pool, truth[seqs[i]], at[i], prompts.out(i), prompts.lse(i)), "")
          << "prefill of sequence " << seqs[i] << " on rank " << me;
  }

  // One decode call of tn new tokens of each of seqs (in that order), checked on every rank;
  // returns out and lse.
  std::pair<Tensor, Tensor> decode_step(const std::vector<int64_t>& seqs, int64_t tn = 1) {
    const int64_t b = int64_t(seqs.size());
    Tensor q(DType::f32, {b, tn, kHq, kD}), k(DType::f32, {b, tn, kHkv, kD}),
        v(DType::f32, {b, tn, kHkv, kD}), out(DType::f32, {b, tn, kHq, kD}),
        lse(DType::f32, {b, kHq, tn});
    for (int64_t i = 0; i < b; ++i) {
      const Rows added = fresh(tn);
      copy_into(rows_of(pool.q, added), q.view().slice(0, i, i + 1));
      copy_into(rows_of(pool.k, added), k.view().slice(0, i, i + 1));
      copy_into(rows_of(pool.v, added), v.view().slice(0, i, i + 1));
      truth[seqs[i]].insert(truth[seqs[i]].end(), added.begin(), added.end());
    }
    decode(cache, seqs, q, k, v, out, lse);
    for (int64_t i = 0; i < b; ++i) {
      const Rows& rows = truth[seqs[i]];
      std::vector<int64_t> at;
      for (int64_t t = 0; t < tn; ++t) at.push_back(int64_t(rows.size()) - tn + t);
      EXPECT_EQ(
          check_rows(pool, rows, at, out.view().slice(0, i, i + 1), lse.view().slice(0, i, i + 1)),
          "")
          << "decode of sequence " << seqs[i];
      EXPECT_EQ(cache.tokens(seqs[i]), int64_t(rows.size()));
    }
    return {std::move(out), std::move(lse)};
  }
};

}  // namespace

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

namespace {

// Everything a refused call could change on this rank: the slot table, each live slot's
// length, positions and K/V bytes, and the memory held.
struct Snapshot {
  std::vector<std::vector<int64_t>> slots;  // {live, tokens, positions...}
  std::vector<std::vector<std::byte>> kv;
  size_t bytes = 0;
  bool operator==(const Snapshot&) const = default;
};

Snapshot snapshot(const KvCache& c) {
  Snapshot s;
  s.bytes = c.bytes();
  for (int64_t i = 0; i < c.slots(); ++i) {
    std::vector<int64_t> row{c.live(i)};
    std::vector<std::byte> kv;
    if (c.live(i)) {
      row.push_back(c.tokens(i));
      const Tokens t = c.local_token_ids(i);
      row.insert(row.end(), t.positions.begin(), t.positions.end());
      for (const TensorView& x : {c.k(i), c.v(i)}) {
        if (x.empty()) continue;
        const Tensor dense = Tensor::copy_of(x);
        const auto* p = static_cast<const std::byte*>(dense.data());
        kv.insert(kv.end(), p, p + dense.bytes());
      }
    }
    s.slots.push_back(row);
    s.kv.push_back(kv);
  }
  return s;
}

// fn's refusal on every rank of p: each rank's message (every rank must refuse), and the
// cache of each rank as it was before.
std::vector<std::string> refused_everywhere(
    int p, const std::function<void(Communicator&, KvCache&)>& setup,
    const std::function<void(Communicator&, KvCache&)>& call, KvCacheOptions o = slot_options(3)) {
  std::vector<std::string> errors(static_cast<size_t>(p));
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(20);
  run_threads(
      p,
      [&](Communicator& comm) {
        KvCache cache(comm, o);
        setup(comm, cache);
        const Snapshot before = snapshot(cache);
        try {
          call(comm, cache);
          ADD_FAILURE() << "accepted on rank " << comm.rank();
        } catch (const Error& e) {
          errors[comm.rank()] = e.what();
        }
        EXPECT_TRUE(snapshot(cache) == before) << "rank " << comm.rank() << " changed";
      },
      opt);
  return errors;
}

void expect_all_contain(const std::vector<std::string>& errors, const std::string& want) {
  for (size_t r = 0; r < errors.size(); ++r)
    EXPECT_NE(errors[r].find(want), std::string::npos) << "rank " << r << ": " << errors[r];
}

// Three sequences of 30, 45 and 12 tokens, appended whole.
void three_sequences(Communicator&, KvCache& c) {
  c.append(0, normal({1, 30, kHkv, kD}, 1), normal({1, 30, kHkv, kD}, 2));
  c.append(1, normal({1, 45, kHkv, kD}, 3), normal({1, 45, kHkv, kD}, 4));
  c.append(2, normal({1, 12, kHkv, kD}, 5), normal({1, 12, kHkv, kD}, 6));
}

// decode of one token of each of seqs (seeded rows), Tn tokens on this rank.
void decode_of(KvCache& c, const std::vector<int64_t>& seqs, int64_t tn = 1, uint64_t seed = 7) {
  const int64_t b = int64_t(seqs.size());
  Tensor out(DType::f32, {b, tn, kHq, kD}), lse(DType::f32, {b, kHq, tn});
  decode(c, seqs, normal({b, tn, kHq, kD}, seed), normal({b, tn, kHkv, kD}, seed + 1),
         normal({b, tn, kHkv, kD}, seed + 2), out, lse);
}

}  // namespace

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

// ---- paged storage (docs/inference.md, "Paged storage") -------------------------------------

namespace {

bool same_bits(const TensorView& a, const TensorView& b) {
  if (a.empty() || b.empty()) return a.empty() && b.empty();
  const Tensor x = Tensor::copy_of(a), y = Tensor::copy_of(b);
  return x.shape() == y.shape() && std::memcmp(x.data(), y.data(), x.bytes()) == 0;
}

// Sequence 0 holds a 70-token prompt; sequences 1 and 2 all of it and its first 40 tokens:
// forks (pages shared), or copies appended afresh (what fork made before pages). Then the
// three decode other tokens, twice (each checked against its own sequence's fp64 reference).
// Returns the decodes' out and lse.
std::vector<Tensor> forked_or_copied(Communicator& comm, const Pool& pool, bool fork) {
  KvCache cache(comm, slot_options(1));
  Server s{pool, cache, {}};
  s.prefill_prompts({0}, {70});
  const size_t before = cache.bytes();
  for (int64_t n : {70, 40}) {
    const Rows prefix(s.truth[0].begin(), s.truth[0].begin() + n);
    const int64_t c = fork ? cache.fork(0, n) : cache.add();
    if (!fork) cache.append(c, rows_of(pool.k, prefix), rows_of(pool.v, prefix));
    s.truth[c] = prefix;
  }
  if (fork) EXPECT_EQ(cache.bytes(), before) << "a fork takes no page";
  std::vector<Tensor> outputs;
  for (int step = 0; step < 2; ++step) {
    auto [out, lse] = s.decode_step({0, 1, 2});
    outputs.push_back(std::move(out));
    outputs.push_back(std::move(lse));
  }
  return outputs;
}

}  // namespace

TEST(KvCachePages, ForksDecodeAsCopiesWouldWithoutCopying) {
  const Pool pool;
  for (int p : {1, 2, 3}) {
    SCOPED_TRACE("P=" + std::to_string(p));
    run_threads(p, [&](Communicator& comm) {
      const std::vector<Tensor> forked = forked_or_copied(comm, pool, true),
                                copied = forked_or_copied(comm, pool, false);
      for (size_t i = 0; i < forked.size(); ++i)
        EXPECT_TRUE(same_bits(forked[i], copied[i])) << "output " << i << ", rank " << comm.rank();
    });
  }
}

// 8 samples of a 4000-token prompt: the forks take no page; their first tokens copy the one
// page they share and write into (block 62, tokens 3968..4031), nothing else, on any rank.
TEST(KvCachePages, EightForksOfALongPromptShareItsPages) {
  for (int p : {1, 2, 3}) {
    SCOPED_TRACE("P=" + std::to_string(p));
    run_threads(p, [&](Communicator& comm) {
      KvCacheOptions o = slot_options(1);
      o.block = 64;
      KvCache cache(comm, o);
      cache.append(0, normal({1, 4000, kHkv, kD}, 1), normal({1, 4000, kHkv, kD}, 2));
      const size_t prompt = cache.bytes(), page = size_t(o.block) * cache.token_bytes();
      EXPECT_EQ(prompt, cache.bytes_for({4000}, comm.rank()));
      std::vector<int64_t> forks;
      for (int i = 0; i < 8; ++i) {
        forks.push_back(cache.fork(0));
        EXPECT_EQ(cache.bytes(), prompt) << "fork " << i;
      }
      for (int64_t f : forks)
        cache.append(f, normal({1, 1, kHkv, kD}, 10 + f), normal({1, 1, kHkv, kD}, 20 + f));
      EXPECT_EQ(cache.bytes(), prompt + (comm.rank() == 62 % p ? 8 * page : 0));
    });
  }
}

// A truncated fork's append writes into the page it shares with its parent: the page is copied
// first (the parent's rows stay, bit for bit), and the fork outlives its parent's free().
TEST(KvCachePages, AWriteIntoASharedPageCopiesItFirst) {
  const Pool pool;
  for (int p : {2, 3}) {
    SCOPED_TRACE("P=" + std::to_string(p));
    run_threads(p, [&](Communicator& comm) {
      KvCache cache(comm, slot_options(1));
      Server s{pool, cache, {}};
      s.prefill_prompts({0}, {50});  // blocks of 16: block 2 holds tokens 32..47
      const Tensor k0 = Tensor::copy_of(cache.k(0)), v0 = Tensor::copy_of(cache.v(0));
      const int64_t c = cache.fork(0);
      const size_t shared = cache.bytes(), page = 16 * cache.token_bytes();
      cache.truncate(c, 40);  // into block 2, which stays: sequence 0 holds it
      EXPECT_EQ(cache.bytes(), shared);
      s.truth[c] = Rows(s.truth[0].begin(), s.truth[0].begin() + 40);
      const Rows added = s.fresh(5);
      cache.append(c, rows_of(pool.k, added), rows_of(pool.v, added));
      s.truth[c].insert(s.truth[c].end(), added.begin(), added.end());
      EXPECT_EQ(cache.bytes(), shared + (comm.rank() == 2 % p ? page : 0));
      EXPECT_TRUE(same_bits(cache.k(0), k0)) << "rank " << comm.rank();
      EXPECT_TRUE(same_bits(cache.v(0), v0)) << "rank " << comm.rank();
      // The fork holds its own rows: the truth's, at this rank's positions.
      const Tokens mine = cache.local_token_ids(c);
      Rows held;
      for (int64_t t : mine.positions) held.push_back(s.truth[c][size_t(t)]);
      EXPECT_TRUE(
          same_bits(cache.k(c), held.empty() ? TensorView() : rows_of(pool.k, held).view()));
      EXPECT_TRUE(
          same_bits(cache.v(c), held.empty() ? TensorView() : rows_of(pool.v, held).view()));
      const Tensor kc = Tensor::copy_of(cache.k(c));
      cache.free(0);
      EXPECT_TRUE(same_bits(cache.k(c), kc.view()));
      s.truth.erase(0);
      s.decode_step({c});
      s.decode_step({c});
    });
  }
}

// KvCacheOptions::max_bytes_per_rank counts a page shared by forks once, every rank the same:
// 8 forks of a 40-token prompt fit in the prompt's own pages (rank 0: blocks 0 and 2; rank 1:
// block 1); a decode that would copy the shared block 2 three times is refused on every rank.
TEST(KvCachePages, LimitsCountASharedPageOnce) {
  KvCacheOptions o = slot_options(1);
  const size_t page = kv_cache_bytes(o, {16}, 1, 0);  // one block on one rank: one page
  o.max_bytes_per_rank = double(3 * page);
  auto prompt_and_forks = [](Communicator&, KvCache& c) {
    c.append(0, normal({1, 40, kHkv, kD}, 1), normal({1, 40, kHkv, kD}, 2));
    for (int i = 0; i < 8; ++i) EXPECT_EQ(c.fork(0), i + 1);
  };
  const auto errors = refused_everywhere(
      2, prompt_and_forks,
      [](Communicator&, KvCache& c) {
        decode_of(c, {0, 1, 2});
      },
      o);
  expect_all_contain(errors, "KV cache: rank 0 would hold " + std::to_string(5 * page) + " bytes");
  expect_all_contain(errors, "over KvCacheOptions::max_bytes_per_rank");
  run_threads(2, [&](Communicator& comm) {  // one copy fits: 3 pages on rank 0
    KvCache cache(comm, o);
    prompt_and_forks(comm, cache);
    decode_of(cache, {0});
    EXPECT_EQ(cache.bytes(), (comm.rank() == 0 ? 3 : 1) * page);
  });
}

// A fork on rank 0 and a copy of the same rows on rank 1: the same lengths, other block tables
// (the copy's own pages). The next decode is refused on every rank, naming them.
TEST(KvCachePages, RanksWhoseBlockTablesDifferAreRefused) {
  expect_all_contain(
      refused_everywhere(
          2,
          [](Communicator& comm, KvCache& c) {
            three_sequences(comm, c);
            if (comm.rank() == 0) {
              EXPECT_EQ(c.fork(0), 3);
            } else {
              EXPECT_EQ(c.add(), 3);
              c.append(3, normal({1, 30, kHkv, kD}, 1), normal({1, 30, kHkv, kD}, 2));
            }
          },
          [](Communicator&, KvCache& c) { decode_of(c, {0}); }),
      "block tables");
}
