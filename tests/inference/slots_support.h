// Shared by the slot and page tests (slots_test.cc, pages_test.cc): a server's calls on the
// spread KV cache, each checked against the fp64 reference of what its sequences hold by then,
// and refused calls, checked on every rank to leave each rank's cache as it was.
#pragma once
#include <gtest/gtest.h>

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/inference.h"
#include "inference/inference_support.h"

namespace ctxpar::testing {

constexpr int64_t kHq = 4, kHkv = 2, kD = 16, kPool = 400;

KvCacheOptions slot_options(int64_t sequences);

Tensor normal(Shape shape, uint64_t seed);

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
                       const TensorView& out, const TensorView& lse);

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

// fn's refusal on every rank of p: each rank's message (every rank must refuse), and the
// cache of each rank as it was before.
std::vector<std::string> refused_everywhere(
    int p, const std::function<void(Communicator&, KvCache&)>& setup,
    const std::function<void(Communicator&, KvCache&)>& call, KvCacheOptions o = slot_options(3));

void expect_all_contain(const std::vector<std::string>& errors, const std::string& want);

// Three sequences of 30, 45 and 12 tokens, appended whole.
void three_sequences(Communicator&, KvCache& c);

// decode of one token of each of seqs (seeded rows), Tn tokens on this rank.
void decode_of(KvCache& c, const std::vector<int64_t>& seqs, int64_t tn = 1, uint64_t seed = 7);

}  // namespace ctxpar::testing
