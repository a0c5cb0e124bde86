// KvCache's paged storage (docs/inference.md, "Paged storage"): forks take no page and decode
// with the bits of copies, a write into a shared page copies it first, the limits count a
// shared page once, and ranks whose block tables differ are refused.
#include <gtest/gtest.h>

#include <cstring>

#include "inference/inference_support.h"
#include "inference/slots_support.h"
#include "same_bits.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

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
  if (fork) {
    EXPECT_EQ(cache.bytes(), before) << "a fork takes no page";
  }
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
        EXPECT_TRUE(test::same_bits(forked[i], copied[i]))
            << "output " << i << ", rank " << comm.rank();
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
      EXPECT_TRUE(test::same_bits(cache.k(0), k0)) << "rank " << comm.rank();
      EXPECT_TRUE(test::same_bits(cache.v(0), v0)) << "rank " << comm.rank();
      // The fork holds its own rows: the truth's, at this rank's positions.
      const Tokens mine = cache.local_token_ids(c);
      Rows held;
      for (int64_t t : mine.positions) held.push_back(s.truth[c][size_t(t)]);
      EXPECT_TRUE(
          test::same_bits(cache.k(c), held.empty() ? TensorView() : rows_of(pool.k, held).view()));
      EXPECT_TRUE(
          test::same_bits(cache.v(c), held.empty() ? TensorView() : rows_of(pool.v, held).view()));
      const Tensor kc = Tensor::copy_of(cache.k(c));
      cache.free(0);
      EXPECT_TRUE(test::same_bits(cache.k(c), kc.view()));
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
