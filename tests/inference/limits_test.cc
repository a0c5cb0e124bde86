// The cache's limits (refused before anything changes, naming the field, on every rank), its
// memory report, and argument errors that every rank sees together.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <limits>
#include <cstring>
#include <functional>

#include "ctxpar/error.h"
#include "ctxpar/limits.h"
#include "ctxpar/memory.h"
#include "ctxpar/strategy.h"
#include "inference/inference_support.h"
#include "inference/internal.h"
#include "inference/slots_support.h"
#include "same_bits.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

KvCacheOptions small_options() {
  KvCacheOptions o;
  o.head_dim = 16;
  o.kv_heads = 2;
  o.block = 16;
  o.mask = Mask::causal_mask();
  return o;
}

// Runs fn on P threads; each rank's error message ("" when it returned normally).
std::vector<std::string> errors_of(int p, const std::function<void(Communicator&)>& fn) {
  std::vector<std::string> errors(static_cast<size_t>(p));
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(20);
  try {
    run_threads(
        p,
        [&](Communicator& comm) {
          try {
            fn(comm);
          } catch (const Error& e) {
            errors[comm.rank()] = e.what();
            throw;
          }
        },
        opt);
  } catch (const Error&) {}
  return errors;
}

Tensor kv_rows(int64_t n, uint64_t seed) {
  Tensor t(DType::f32, {1, n, 2, 16});
  fill_normal(t, seed);
  return t;
}

}  // namespace

TEST(KvCacheLimits, TokensPerRankRefusedOnEveryRankBeforeAnyChange) {
  const auto errors = errors_of(2, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    o.max_tokens_per_rank = 40;
    KvCache cache(comm, o);
    cache.append(0, kv_rows(64, 1), kv_rows(64, 2));  // 32 tokens each
    try {
      cache.append(0, kv_rows(20, 3), kv_rows(20, 4));  // rank 0 would hold 48
    } catch (const Error&) {
      EXPECT_EQ(cache.tokens(0), 64);
      EXPECT_EQ(cache.local_tokens(0), 32);
      throw;
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("KvCacheOptions::max_tokens_per_rank = 40"), std::string::npos) << e;
    EXPECT_NE(e.find("rank 0 would hold 48 tokens"), std::string::npos) << e;
  }
}

TEST(KvCacheLimits, BytesPerRankRefusedNamingTheField) {
  const auto errors = errors_of(3, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    // One token: k + v (2 x 2 x 16 fp32) + its position = 264 bytes; a shard grows in doubling
    // whole blocks (16, 32, 64 ... tokens).
    ASSERT_EQ(KvCache(comm, o).token_bytes(), 264u);
    o.max_bytes_per_rank = 32 * 264;
    KvCache cache(comm, o);
    cache.append(0, kv_rows(96, 1), kv_rows(96, 2));  // 32 tokens each: 32 slots
    EXPECT_EQ(cache.bytes(), 32u * 264);
    EXPECT_EQ(cache.bytes_for({96}, comm.rank()), 32u * 264);
    cache.append(0, kv_rows(1, 3), kv_rows(1, 4));  // rank 0 would need 64 slots
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("over KvCacheOptions::max_bytes_per_rank"), std::string::npos) << e;
}

TEST(KvCacheLimits, MemoryLimitOfTheProcessIsHonoured) {
  setenv(kMemoryLimitEnv, "100000", 1);
  const auto errors = errors_of(1, [](Communicator& comm) {
    KvCache cache(comm, small_options());
    cache.append(0, kv_rows(512, 1), kv_rows(512, 2));  // 512 * 264 bytes > 100000
  });
  unsetenv(kMemoryLimitEnv);
  EXPECT_NE(errors[0].find("KV cache: rank 0 cannot grow its shard"), std::string::npos)
      << errors[0];
  EXPECT_NE(errors[0].find(kMemoryLimitEnv), std::string::npos) << errors[0];
}

TEST(KvCacheLimits, BadOptionsNameTheField) {
  run_threads(1, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    o.head_dim = 8;
    try {
      KvCache cache(comm, o);
      ADD_FAILURE() << "head_dim 8 accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KvCacheOptions::head_dim"), std::string::npos);
    }
    o = small_options();
    o.block = 0;
    EXPECT_THROW(KvCache(comm, o), Error);
  });
}

TEST(Prefill, ARanksBadArgumentsStopEveryRank) {
  const auto errors = errors_of(3, [](Communicator& comm) {
    KvCache cache(comm, small_options());
    const int64_t tl = int64_t(cache.placement(0, 100, comm.rank()).size()) +
                       (comm.rank() == 1 ? 1 : 0);  // rank 1 gives one row too many
    Tensor q(DType::f32, {1, tl, 4, 16}), k(DType::f32, {1, tl, 2, 16}),
        v(DType::f32, {1, tl, 2, 16}), out(DType::f32, {1, tl, 4, 16}), lse(DType::f32, {1, 4, tl});
    prefill(cache, 0, 100, q, k, v, out, lse);
  });
  for (int r : {0, 1, 2})
    EXPECT_NE(errors[r].find("prefill: invalid arguments on rank 1 (of 3): q: expected shape"),
              std::string::npos)
        << errors[r];
}

TEST(Decode, BadArgumentsNameTheArgument) {
  run_threads(2, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    o.sequences = 2;
    KvCache cache(comm, o);
    Tensor q(DType::f32, {2, 1, 4, 16}), k(DType::f32, {2, 1, 2, 16}),
        out(DType::f32, {2, 1, 4, 16}), lse(DType::f32, {2, 4, 1}), bad(DType::f32, {1, 1, 2, 16});
    try {
      decode(cache, q, bad, k, out, lse);
      ADD_FAILURE() << "k_new of one sequence accepted for two";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("k_new: expected shape"), std::string::npos) << e.what();
    }
    Tensor q3(DType::f32, {2, 1, 3, 16});
    EXPECT_THROW(decode(cache, q3, k, k, out, lse), Error);  // 3 heads over 2 KV heads
    EXPECT_EQ(cache.tokens(0), 0);
  });
}

TEST(KvCacheGrowth, ReservedAndAppendedLocallyEqualsAppendedWhole) {
  run_threads(2, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    KvCache whole(comm, o), local(comm, o);
    const Tensor k = kv_rows(70, 1), v = kv_rows(70, 2);
    whole.append(0, k, v);
    local.reserve({100});
    EXPECT_EQ(local.bytes(), local.bytes_for({100}, comm.rank()));
    const std::vector<int64_t> mine = local.placement(0, 70, comm.rank());
    local.append_local(0, 70, rows_of(k, mine), rows_of(v, mine));
    EXPECT_EQ(local.bytes(), local.bytes_for({100}, comm.rank()));  // no growth
    ASSERT_EQ(local.local_tokens(0), whole.local_tokens(0));
    const Tensor a = Tensor::copy_of(whole.k(0)), b = Tensor::copy_of(local.k(0));
    EXPECT_EQ(std::memcmp(a.data(), b.data(), a.bytes()), 0);
    const Tokens ta = whole.local_token_ids(0), tb = local.local_token_ids(0);
    EXPECT_TRUE(std::equal(ta.positions.begin(), ta.positions.end(), tb.positions.begin()));
  });
}

TEST(Prefill, RanksThatDisagreeOnTheModeAreRefused) {
  const auto errors = errors_of(2, [](Communicator& comm) {
    KvCache cache(comm, small_options());
    const int64_t tl = int64_t(cache.placement(0, 50, comm.rank()).size());
    Tensor q(DType::f32, {1, tl, 4, 16}), k(DType::f32, {1, tl, 2, 16}),
        v(DType::f32, {1, tl, 2, 16}), out(DType::f32, {1, tl, 4, 16}), lse(DType::f32, {1, 4, tl});
    prefill(cache, 0, 50, q, k, v, out, lse,
            comm.rank() == 1 ? PrefillMode::pass_q : PrefillMode::pass_kv);
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("prefill: the ranks were called with different arguments: mode is pass-kv "
                     "on rank 0 but pass-q on rank 1"),
              std::string::npos)
        << e;
}

// Round five: the bf16 tier (KvCacheOptions::kernel.bf16_tier) is agreed by the first prefill or
// decode, with the machine's bf16 products: ranks whose caches differ in it are refused on every
// rank, naming it, instead of mixing two roundings into one answer.
TEST(KvCacheAgreement, RanksWithDifferentBf16TiersAreRefusedNamingIt) {
  for (const bool prefill_first : {true, false}) {
    SCOPED_TRACE(prefill_first ? "prefill" : "decode");
    const auto errors = errors_of(2, [&](Communicator& comm) {
      KvCacheOptions o = small_options();
      o.dtype = DType::bf16;
      o.kernel.bf16_tier = comm.rank() == 1 ? Bf16Tier::fast : Bf16Tier::exact;
      KvCache cache(comm, o);
      const int64_t tl = int64_t(cache.placement(0, 50, comm.rank()).size());
      Tensor q(DType::bf16, {1, tl, 4, 16}), k(DType::bf16, {1, tl, 2, 16}),
          out(DType::f32, {1, tl, 4, 16}), lse(DType::f32, {1, 4, tl});
      if (prefill_first) {
        prefill(cache, 0, 50, q, k, k, out, lse);
        return;
      }
      Tensor qd(DType::bf16, {1, 1, 4, 16}), kd(DType::bf16, {1, 1, 2, 16}),
          od(DType::f32, {1, 1, 4, 16}), ld(DType::f32, {1, 4, 1});
      decode(cache, qd, kd, kd, od, ld);
    });
    const std::string want = std::string(prefill_first ? "prefill" : "decode") +
                             ": the ranks were called with different arguments: bf16 tier "
                             "(KvCacheOptions::kernel.bf16_tier) is exact on rank 0 but fast on "
                             "rank 1";
    for (const std::string& e : errors) EXPECT_NE(e.find(want), std::string::npos) << e;
  }
}

// Every option that places, masks, scales, shapes or limits rows is agreed at the first call,
// prefill or decode, before any check that reads the options: a rank with its own block, mask,
// scale, limit, KV heads or head dim is refused naming the field (before: block, mask and
// scale ran on, each rank placing or computing its own way; a decode with its own kv_heads
// failed its shape check alone and left the other rank waiting).
TEST(KvCacheAgreement, RanksWithDifferentCacheOptionsAreRefusedNamingTheField) {
  using Edit = std::function<void(KvCacheOptions&)>;
  const std::pair<const char*, Edit> cases[] = {
      {"block (KvCacheOptions::block) is 16 on rank 0 but 32 on rank 1",
       [](KvCacheOptions& o) { o.block = 32; }},
      {"mask (KvCacheOptions::mask) is causal on rank 0 but causal+window:8,0 on rank 1",
       [](KvCacheOptions& o) { o.mask.window_left = 8, o.mask.window_right = 0; }},
      {"scale (KvCacheOptions::kernel.scale) is 0 on rank 0 but 0.5 on rank 1",
       [](KvCacheOptions& o) { o.kernel.scale = 0.5f; }},
      {"max_tokens_per_rank (KvCacheOptions::max_tokens_per_rank) is 0 on rank 0 but 1000 on "
       "rank 1",
       [](KvCacheOptions& o) { o.max_tokens_per_rank = 1000; }},
      {"kv_heads (KvCacheOptions::kv_heads) is 2 on rank 0 but 1 on rank 1",
       [](KvCacheOptions& o) { o.kv_heads = 1; }},
      {"head_dim (KvCacheOptions::head_dim) is 16 on rank 0 but 32 on rank 1",
       [](KvCacheOptions& o) { o.head_dim = 32; }},
      {"merge (KvCacheOptions::merge) is allgather on rank 0 but tree on rank 1",
       [](KvCacheOptions& o) { o.merge = DecodeMerge::tree; }}};
  for (const bool prefill_first : {true, false})
    for (const auto& [want, edit] : cases) {
      const std::string call = prefill_first ? "prefill" : "decode";
      SCOPED_TRACE(call + ": " + want);
      const auto errors = errors_of(2, [&](Communicator& comm) {
        KvCacheOptions o = small_options();
        o.block = 16, o.mask = Mask::causal_mask();
        if (comm.rank() == 1) edit(o);
        KvCache cache(comm, o);
        // The same shapes on every rank (rank 0's options), as a caller passes the same rows:
        // a check that read the options before the agreement would fail on rank 1 alone.
        const int64_t hkv = 2, d = 16;
        const int64_t tl = prefill_first ? int64_t(cache.placement(0, 50, comm.rank()).size()) : 1;
        Tensor q(DType::f32, {1, tl, 4, d}), k(DType::f32, {1, tl, hkv, d}),
            out(DType::f32, {1, tl, 4, d}), lse(DType::f32, {1, 4, tl});
        if (prefill_first)
          prefill(cache, 0, 50, q, k, k, out, lse);
        else
          decode(cache, q, k, k, out, lse);
      });
      for (const std::string& e : errors)
        EXPECT_NE(e.find(call + ": the ranks were called with different arguments: " + want),
                  std::string::npos)
            << e;
    }
}

TEST(Decode, RanksWhoseCachesDifferAreRefused) {
  const auto errors = errors_of(2, [](Communicator& comm) {
    KvCache cache(comm, small_options());
    // A misuse: append_local with a different count on each rank (nothing checks it there).
    const int64_t count = comm.rank() == 0 ? 40 : 41;
    const std::vector<int64_t> mine = cache.placement(0, count, comm.rank());
    cache.append_local(0, count, rows_of(kv_rows(count, 1), mine),
                       rows_of(kv_rows(count, 2), mine));
    Tensor q(DType::f32, {1, 1, 4, 16}), k(DType::f32, {1, 1, 2, 16}),
        out(DType::f32, {1, 1, 4, 16}), lse(DType::f32, {1, 4, 1});
    try {
      decode(cache, q, k, k, out, lse);
    } catch (const Error&) {
      EXPECT_EQ(cache.tokens(0), count);  // refused before the new token was stored
      throw;
    }
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("lengths of the decoded sequences (KvCache::tokens) is 40 on rank 0 but 41 "
                     "on rank 1"),
              std::string::npos)
        << e;
}

// Note [The cache checks K/V at the door]: a NaN / Inf key or value is refused when it would be
// stored -- append, append_local, decode's new token -- naming the sequence and the token, on
// every rank together, and nothing changes; decode then skips rescanning the shard.
TEST(KvCacheFinite, NonFiniteKeysAndValuesAreRefusedWhereTheyEnter) {
  const auto errors = errors_of(2, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    o.sequences = 2;
    KvCache cache(comm, o);
    const Tensor k = kv_rows(40, 1), v = kv_rows(40, 2);
    cache.append(1, k, v);
    Tensor bad = Tensor::copy_of(v);
    bad.ptr<float>()[(33 * 2 + 1) * 16 + 5] = std::numeric_limits<float>::infinity();
    try {
      cache.append(1, k, bad);
      ADD_FAILURE() << "an Inf value was stored";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("v: non-finite value (inf) in sequence 1, token 73, "
                                           "kv head 1, dim 5"),
                std::string::npos)
          << e.what();
    }
    EXPECT_EQ(cache.tokens(1), 40);
    // append_local names the token's index in the sequence, not the row of this rank.
    // mine holds sequence indices in [40, 80): rows of an 80-token K/V (reading them from the
    // 40-row k read past its end, and the garbage sometimes held a NaN of its own first).
    const std::vector<int64_t> mine = cache.placement(40, 40, comm.rank());
    const Tensor k80 = kv_rows(80, 3), v80 = kv_rows(80, 4);
    Tensor local = rows_of(k80, mine);
    local.ptr<float>()[3 * 2 * 16] = std::nanf("");
    try {
      cache.append_local(1, 40, local, rows_of(v80, mine));
      ADD_FAILURE() << "a NaN key was stored";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("k: non-finite value (nan) in sequence 1, token " +
                                           std::to_string(mine[3]) + ", kv head 0"),
                std::string::npos)
          << e.what();
    }
    // decode: the new token's key, the same on every rank: every rank refuses.
    Tensor q(DType::f32, {2, 1, 4, 16}), kn(DType::f32, {2, 1, 2, 16}),
        out(DType::f32, {2, 1, 4, 16}), lse(DType::f32, {2, 4, 1});
    kn.ptr<float>()[2 * 16 + 7] = std::nanf("");  // sequence 1, head 0, dim 7
    decode(cache, q, kn, kn, out, lse);
  });
  for (const std::string& e : errors)
    EXPECT_NE(e.find("k_new: non-finite value (nan) in sequence 1, token 40, kv head 0, dim 7"),
              std::string::npos)
        << e;
}

// ---- A refused call changes nothing ------------------------------------------------------
// "Nothing changes" is checked against a twin cache that never saw the refused call: the same
// lengths and shards, and the next calls give the same bits.

namespace {

void expect_same_cache(const KvCache& a, const KvCache& b) {
  for (int64_t s = 0; s < a.options().sequences; ++s) {
    EXPECT_EQ(a.tokens(s), b.tokens(s)) << "sequence " << s;
    ASSERT_EQ(a.local_tokens(s), b.local_tokens(s)) << "sequence " << s;
    EXPECT_TRUE(test::same_bits(Tensor::copy_of(a.k(s)), Tensor::copy_of(b.k(s))))
        << "sequence " << s;
  }
}

// decode of the same new token on both caches: out and lse bitwise equal.
void expect_same_decode(KvCache& a, KvCache& b, uint64_t seed) {
  const int64_t n = a.options().sequences;
  const Tensor q = normal({n, 1, 4, 16}, seed), k = normal({n, 1, 2, 16}, seed + 1),
               v = normal({n, 1, 2, 16}, seed + 2);
  Tensor out_a(DType::f32, {n, 1, 4, 16}), lse_a(DType::f32, {n, 4, 1});
  Tensor out_b(DType::f32, {n, 1, 4, 16}), lse_b(DType::f32, {n, 4, 1});
  decode(a, q, k, v, out_a, lse_a);
  decode(b, q, k, v, out_b, lse_b);
  EXPECT_TRUE(test::same_bits(out_a, out_b) && test::same_bits(lse_a, lse_b));
}

}  // namespace

// A NaN query was found by the kernel after decode had stored the token's K/V: a retry held the
// token twice. The query is checked with the keys, before anything is stored.
TEST(KvCacheRefusal, DecodeWithANonFiniteQueryStoresNothing) {
  ThreadsOptions opt;
  opt.timeout = std::chrono::seconds(20);
  run_threads(
      2,
      [](Communicator& comm) {
        KvCacheOptions o = small_options();
        o.sequences = 2;
        KvCache refused(comm, o), twin(comm, o);
        for (KvCache* c : {&refused, &twin}) {
          c->append(0, kv_rows(40, 1), kv_rows(40, 2));
          c->append(1, kv_rows(25, 3), kv_rows(25, 4));
        }
        Tensor q = normal({2, 1, 4, 16}, 5);
        q.ptr<float>()[(1 * 4 + 3) * 16 + 2] = std::nanf("");  // sequence 1, head 3, dim 2
        Tensor out(DType::f32, {2, 1, 4, 16}), lse(DType::f32, {2, 4, 1});
        try {
          decode(refused, q, normal({2, 1, 2, 16}, 6), normal({2, 1, 2, 16}, 7), out, lse);
          ADD_FAILURE() << "a NaN query was attended";
        } catch (const Error& e) {
          EXPECT_NE(std::string(e.what()).find("q: non-finite value (nan) in sequence 1, token 25, "
                                               "head 3, dim 2"),
                    std::string::npos)
              << e.what();
        }
        expect_same_cache(refused, twin);
        expect_same_decode(refused, twin, 8);
      },
      opt);
}

// A NaN in one rank's own rows (a key: pass-KV; a query: pass-Q): that rank refused alone,
// after storing its rows and sending its ring messages, which the next call then took for its
// own. Every check is in the verdict the ranks agree on before anything is stored or sent.
TEST(KvCacheRefusal, PrefillRefusedOnOneRankStoresAndSendsNothing) {
  for (const bool key : {true, false}) {
    SCOPED_TRACE(key ? "NaN key, pass-kv" : "NaN query, pass-q");
    const PrefillMode mode = key ? PrefillMode::pass_kv : PrefillMode::pass_q;
    std::vector<std::string> errors(2);
    ThreadsOptions opt;
    opt.timeout = std::chrono::seconds(20);
    run_threads(
        2,
        [&](Communicator& comm) {
          KvCache refused(comm, small_options()), twin(comm, small_options());
          const Tensor q = normal({1, 70, 4, 16}, 1), k = kv_rows(70, 2), v = kv_rows(70, 3);
          // Prefills tokens [first, first + count) of q, k, v: this rank's rows of them.
          auto call = [&](KvCache& c, int64_t first, int64_t count, const Tensor& qs,
                          const Tensor& ks) {
            std::vector<int64_t> mine = c.placement(first, count, comm.rank());
            const int64_t tl = int64_t(mine.size());
            Tensor out(DType::f32, {1, tl, 4, 16}), lse(DType::f32, {1, 4, tl});
            prefill(c, 0, count, rows_of(qs, mine), rows_of(ks, mine), rows_of(v, mine), out, lse,
                    mode);
            return std::pair{out, lse};
          };
          call(refused, 0, 40, q, k);
          call(twin, 0, 40, q, k);
          Tensor bad = Tensor::copy_of(key ? k : q);  // token 50: block 3 (48..63), rank 1's
          bad.ptr<float>()[(50 * bad.dim(2) + 1) * 16 + 3] = std::nanf("");
          try {
            call(refused, 40, 30, key ? q : bad, key ? bad : k);
            ADD_FAILURE() << "a NaN was prefilled";
          } catch (const Error& e) {
            errors[comm.rank()] = e.what();
          }
          expect_same_cache(refused, twin);
          const auto [out_a, lse_a] = call(refused, 40, 30, q, k);
          const auto [out_b, lse_b] = call(twin, 40, 30, q, k);
          EXPECT_TRUE(test::same_bits(out_a, out_b) && test::same_bits(lse_a, lse_b));
          expect_same_decode(refused, twin, 9);
        },
        opt);
    const std::string want =
        std::string("prefill: invalid arguments on rank 1 (of 2): ") +
        (key ? "k: non-finite value (nan) in sequence 0, token 50, kv head 1, dim 3"
             : "q: non-finite value (nan) in sequence 0, token 50, head 1, dim 3");
    for (const std::string& e : errors) EXPECT_NE(e.find(want), std::string::npos) << e;
  }
}

// One rule for a cache's mask (check_cache_mask): every later token hidden. "none" or a right
// window made a token's attention depend on how the sequence was cut into prefill calls.
TEST(KvCacheRefusal, MasksThatSeeLaterTokensAreRefusedBeforeTheCacheExists) {
  run_threads(1, [](Communicator& comm) {
    for (const char* text :
         {"none", "causal+window:4,2", "window:-1,5", "window:3,-1", "documents"}) {
      KvCacheOptions o = small_options();
      o.mask = parse_mask(text);
      try {
        KvCache cache(comm, o);
        ADD_FAILURE() << text << " accepted";
      } catch (const Error& e) {
        EXPECT_NE(std::string(e.what()).find(std::string("KvCacheOptions::mask ") + text),
                  std::string::npos)
            << e.what();
        EXPECT_NE(std::string(e.what()).find("use causal or causal+window:L,0"), std::string::npos)
            << e.what();
      }
    }
    // Accepted: no later key visible ("window:30,0" without causal is run against the fp64
    // reference by Inference.EveryPathMatchesTheReference).
    for (const char* text : {"causal", "window:4,0", "causal+window:4,0", "causal+window:4,-1",
                             "causal+documents", "window:-1,0+documents"}) {
      KvCacheOptions o = small_options();
      o.mask = parse_mask(text);
      EXPECT_NO_THROW(KvCache(comm, o)) << text;
    }
  });
}

// KvCacheOptions::sequences took any count (10^9: shards allocated for 22 s, then a failure).
// The command's --batch range, refused before anything is allocated; kv_heads likewise.
TEST(KvCacheRefusal, SequencesBeyondTheBatchRangeAreRefusedBeforeAllocating) {
  run_threads(1, [](Communicator& comm) {
    KvCacheOptions o = small_options();
    o.sequences = kMaxBatch + 1;
    try {
      KvCache cache(comm, o);
      ADD_FAILURE() << "2^20 + 1 sequences accepted";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("KvCacheOptions::sequences must be in [0, 1048576], "
                                           "got 1048577"),
                std::string::npos)
          << e.what();
    }
    o = small_options();
    o.kv_heads = kMaxHeads + 1;
    EXPECT_THROW(KvCache(comm, o), Error);
  });
}

// The KV cache, the strategies and the kernel each had their own [B, T, H, D] check, with three
// texts for one fault. A key whose last dim is strided now gets the one rule's text
// (kernel::activation_verdict) from each of them.
TEST(KvCacheRefusal, AStridedHeadDimGetsTheOneRulesTextFromEveryLayer) {
  const std::string want = "k: the last dimension must be contiguous (stride 1), got stride 2";
  Tensor wide(DType::f32, {1, 4, 2, 32});
  const TensorView k(wide.data(), DType::f32, {1, 4, 2, 16}, {256, 64, 32, 2});
  auto error_of = [](const std::function<void()>& f) {
    try {
      f();
    } catch (const Error& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  };
  const Tensor q = normal({1, 4, 2, 16}, 1), v = normal({1, 4, 2, 16}, 2);
  std::vector<int64_t> positions = {0, 1, 2, 3};
  const Tokens tokens{positions, {}};
  run_threads(1, [&](Communicator& comm) {
    KvCache cache(comm, small_options());
    const std::string e = error_of([&] { cache.append(0, k, v); });
    EXPECT_NE(e.find(want), std::string::npos) << "cache: " << e;
    EXPECT_EQ(cache.tokens(0), 0);  // refused: nothing stored
    Tensor out(DType::f32, {1, 4, 2, 16}), lse(DType::f32, {1, 2, 4});
    auto strategy = Strategy::create(comm, StrategyOptions{});
    const std::string s = error_of([&] { strategy->forward({q, k, v, tokens, out, lse}); });
    EXPECT_NE(s.find(want), std::string::npos) << "strategy: " << s;
  });
  ForwardState state(1, 4, 2, 16);
  const std::string e =
      error_of([&] { attention_forward_block(q, tokens, k, v, tokens, Mask{}, state); });
  EXPECT_NE(e.find(want), std::string::npos) << "kernel: " << e;
}

// Likewise lse [B, H, T]: the cache's decode had its own check and text.
TEST(KvCacheRefusal, ABf16LseGetsTheOneRulesTextFromDecodeAndTheStrategies) {
  const std::string want = "lse: expected dtype fp32, got bf16";
  run_threads(1, [&](Communicator& comm) {
    KvCache cache(comm, small_options());
    cache.append(0, kv_rows(8, 1), kv_rows(8, 2));
    Tensor out(DType::f32, {1, 1, 4, 16}), lse(DType::bf16, {1, 4, 1});
    try {
      decode(cache, normal({1, 1, 4, 16}, 3), normal({1, 1, 2, 16}, 4), normal({1, 1, 2, 16}, 5),
             out, lse);
      ADD_FAILURE() << "decode took a bf16 lse";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << "decode: " << e.what();
    }
    EXPECT_EQ(cache.tokens(0), 8);  // refused: nothing stored
    const Tensor q = normal({1, 4, 2, 16}, 6), k = normal({1, 4, 2, 16}, 7);
    Tensor sout(DType::f32, {1, 4, 2, 16}), slse(DType::bf16, {1, 2, 4});
    std::vector<int64_t> positions = {0, 1, 2, 3};
    try {
      Strategy::create(comm, StrategyOptions{})->forward({q, k, k, {positions, {}}, sout, slse});
      ADD_FAILURE() << "the strategy took a bf16 lse";
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(want), std::string::npos) << "strategy: " << e.what();
    }
  });
}
