// The spread KV cache, prefill (pass-KV, pass-Q) and decode against the fp64 reference of
// whole-sequence attention, on P = 1..4 threads; bitwise properties of decode; the limits.
#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

#include "ctxpar/error.h"
#include "inference/inference_support.h"
#include "inference/internal.h"
#include "same_bits.h"

using namespace ctxpar;
using namespace ctxpar::testing;

namespace {

// Decode rows [from, N) of sequence b of every rank equal rank 0's, bitwise.
bool ranks_agree(const std::vector<RankResult>& rs, int64_t b, int64_t from) {
  for (const RankResult& r : rs) {
    const int64_t n = r.out[b].dim(1), hd = r.out[b].dim(2) * r.out[b].dim(3);
    if (std::memcmp(r.out[b].ptr<float>() + from * hd, rs[0].out[b].ptr<float>() + from * hd,
                    size_t((n - from) * hd) * 4) != 0)
      return false;
  }
  return true;
}

void expect_accurate(const Scenario& s, int p, const std::string& what) {
  const std::vector<RankResult> rs = run_on_threads(s, p);
  for (int64_t b = 0; b < s.sequences(); ++b) {
    EXPECT_EQ(check_accuracy(s, b, combine(rs, s, b)), "")
        << what << " P=" << p << " sequence " << b;
    EXPECT_TRUE(ranks_agree(rs, b, s.prefill[b])) << what << " P=" << p;
  }
}

}  // namespace

TEST(KvCachePlacement, BlockRoundRobinSharesStayWithinOneBlock) {
  for (int p : {1, 2, 3, 4})
    for (int64_t block : {1, 16, 64}) {
      const int64_t cycle = block * p;
      for (int64_t n :
           {int64_t(0), int64_t(1), block - 1, block, cycle + 5, 7 * cycle + block + 3}) {
        int64_t sum = 0, lo = INT64_MAX, hi = 0;
        for (int r = 0; r < p; ++r) {
          int64_t count = 0;
          for (int64_t t = 0; t < n; ++t) count += (t / block) % p == r;
          const int64_t held = placement_held_by(n, r, p, block);
          EXPECT_EQ(held, count) << "n=" << n << " r=" << r << " P=" << p << " block=" << block;
          sum += held, lo = std::min(lo, held), hi = std::max(hi, held);
        }
        EXPECT_EQ(sum, n);
        EXPECT_LE(hi - lo, block);
      }
    }
}

TEST(KvCachePlacement, PlacementListsTheRanksTokensInOrder) {
  run_threads(3, [](Communicator& comm) {
    KvCacheOptions o;
    o.head_dim = 16;
    o.block = 4;
    KvCache cache(comm, o);
    const std::vector<int64_t> got = cache.placement(5, 20, comm.rank());
    std::vector<int64_t> want;
    for (int64_t t = 5; t < 25; ++t)
      if ((t / 4) % 3 == comm.rank()) want.push_back(t);
    EXPECT_EQ(got, want);
    for (int64_t t = 0; t < 30; ++t) EXPECT_EQ(cache.rank_of(t), int((t / 4) % 3));
  });
}

// Masks that let a token see later ones ("none") do not fit incremental inference: a row
// prefilled or decoded earlier cannot see tokens that come later, the whole-sequence reference
// does. Every mask here keeps keys at or before the query.
TEST(Inference, EveryPathMatchesTheReference) {
  struct Case {
    const char* mask;
    PrefillMode mode;
    DType dtype;
    int64_t hq, hkv;
  };
  const Case cases[] = {
      {"causal", PrefillMode::pass_kv, DType::f32, 4, 2},
      {"causal", PrefillMode::pass_q, DType::f32, 4, 2},
      {"window:30,0", PrefillMode::pass_kv, DType::f32, 2, 2},  // a window without "causal"
      {"causal+window:40,0", PrefillMode::pass_q, DType::f32, 4, 1},
      {"causal+documents", PrefillMode::pass_kv, DType::f32, 4, 2},
      {"causal+documents", PrefillMode::pass_q, DType::bf16, 4, 2},
      {"causal", PrefillMode::pass_kv, DType::bf16, 4, 4},
  };
  for (const Case& c : cases) {
    Scenario s;
    s.mask = parse_mask(c.mask);
    s.mode = c.mode;
    s.dtype = c.dtype;
    s.hq = c.hq, s.hkv = c.hkv;
    s.prefill = {90, 37};  // two sequences of different lengths, decoded together
    s.chunk = 40;          // prefill against a cache that grows chunk by chunk
    s.decode_steps = 3;
    s.decode_tokens = 2;
    s.build();
    for (int p : {1, 2, 3, 4})
      expect_accurate(
          s, p, std::string(c.mask) + " " + prefill_mode_name(c.mode) + " " + dtype_name(c.dtype));
  }
}

// The merges across ranks (KvCacheOptions::merge): the chain keeps the all-gather's rank order,
// so its bits; the tree (recursive doubling, folding the ranks past a power of two) merges in
// another order: accurate, the same bits on every rank. P = 8 has three doubling rounds, 3, 5, 6
// and 7 fold ranks in.
TEST(Inference, DecodeMergesAcrossRanks) {
  Scenario s;
  s.prefill = {90, 37};
  s.decode_steps = 2;
  s.decode_tokens = 2;
  s.build();
  for (int p : {2, 3, 4, 5, 6, 7, 8}) {
    const std::vector<RankResult> base = run_on_threads(s, p);
    for (DecodeMerge m : {DecodeMerge::chain, DecodeMerge::tree}) {
      Scenario t = s;
      t.merge = m;
      const std::vector<RankResult> rs = run_on_threads(t, p);
      const std::string what = std::string(decode_merge_name(m)) + " P=" + std::to_string(p);
      for (int64_t b = 0; b < s.sequences(); ++b) {
        EXPECT_EQ(check_accuracy(t, b, combine(rs, t, b)), "") << what << " sequence " << b;
        EXPECT_TRUE(ranks_agree(rs, b, s.prefill[b])) << what;
        if (m == DecodeMerge::chain) {
          for (int r = 0; r < p; ++r) {
            EXPECT_TRUE(test::same_bits(rs[size_t(r)].out[b], base[size_t(r)].out[b]) &&
                        test::same_bits(rs[size_t(r)].lse[b], base[size_t(r)].lse[b]))
                << what << " rank " << r << " sequence " << b;
          }
        }
      }
    }
  }
  EXPECT_EQ(parse_decode_merge("tree"), DecodeMerge::tree);
  EXPECT_THROW(parse_decode_merge("ring"), Error);
}

TEST(Inference, DefaultBlockAndLongerContext) {
  Scenario s;
  s.block = 64;
  s.prefill = {300};
  s.chunk = 128;
  s.decode_steps = 2;
  s.build();
  for (int p : {2, 3}) expect_accurate(s, p, "block 64");
}

TEST(Inference, DecodeOverShardsOfSeveralChunksIsAccurateAndCutIndependent) {
  // Shards longer than decode's chunk (Note [Decode streams the shard in chunks], 1024
  // tokens): 2600 tokens are 3 chunks on one rank, 2 on each of two.
  Scenario a;
  a.block = 64;
  a.prefill = {2600};
  a.decode_steps = 3;
  a.build();
  Scenario b = a;
  b.prefill = {2602};
  b.decode_steps = 1;
  b.mode = PrefillMode::pass_q;
  b.build();
  for (int p : {1, 2}) {
    const auto ra = run_on_threads(a, p), rb = run_on_threads(b, p);
    const Combined c = combine(ra, a, 0);
    EXPECT_EQ(check_accuracy(a, 0, c, 2600), "") << "P=" << p;
    const int64_t n = a.length(0), hd = a.hq * a.d;
    EXPECT_EQ(std::memcmp(ra[0].out[0].ptr<float>() + (n - 1) * hd,
                          rb[0].out[0].ptr<float>() + (n - 1) * hd, size_t(hd) * 4),
              0)
        << "P=" << p;
  }
}

TEST(Inference, DecodeDoesNotDependOnHowMuchWasPrefilled) {
  // prefill 100 then decode 5 == prefill 103 then decode 2, for the two last decoded rows.
  for (int p : {1, 2, 3, 4})
    for (const char* mask : {"causal", "causal+documents"}) {
      Scenario a;
      a.mask = parse_mask(mask);
      a.prefill = {100, 70};
      a.decode_steps = 5;
      a.build();
      Scenario b = a;
      b.prefill = {103, 73};
      b.decode_steps = 2;
      b.mode = PrefillMode::pass_q;
      b.build();
      const auto ra = run_on_threads(a, p), rb = run_on_threads(b, p);
      for (int64_t seq = 0; seq < 2; ++seq) {
        const int64_t n = a.length(seq), hd = a.hq * a.d;
        ASSERT_EQ(n, b.length(seq));
        EXPECT_EQ(std::memcmp(ra[0].out[seq].ptr<float>() + (n - 2) * hd,
                              rb[0].out[seq].ptr<float>() + (n - 2) * hd, size_t(2 * hd) * 4),
                  0)
            << "P=" << p << " " << mask << " sequence " << seq;
        for (int64_t h = 0; h < a.hq; ++h)
          EXPECT_EQ(std::memcmp(ra[0].lse[seq].ptr<float>() + h * n + n - 2,
                                rb[0].lse[seq].ptr<float>() + h * n + n - 2, 8),
                    0);
      }
    }
}

// Decode of forks (KvCache::fork: the parents' pages shared, the partly filled last one copied
// on the first write): the bits of decoding the parents themselves, within the accuracy rule,
// on P = 1..3 (the MPI twin: mpi_main.cc).
TEST(Inference, ForksDecodeWithTheirParentsBits) {
  Scenario s;
  s.prefill = {90, 41};  // blocks of 16: both end inside a shared page
  s.chunk = 40;
  s.build();
  Scenario forked = s;
  forked.fork = true;
  for (int p : {1, 2, 3}) {
    const auto want = run_on_threads(s, p), got = run_on_threads(forked, p);
    for (int64_t b = 0; b < s.sequences(); ++b) {
      const std::string what = "P=" + std::to_string(p) + " sequence " + std::to_string(b);
      for (int r = 0; r < p; ++r) {
        EXPECT_TRUE(test::same_bits(got[r].out[b], want[r].out[b])) << what << " rank " << r;
        EXPECT_TRUE(test::same_bits(got[r].lse[b], want[r].lse[b])) << what << " rank " << r;
      }
      EXPECT_EQ(check_accuracy(forked, b, combine(got, forked, b), s.prefill[b]), "") << what;
    }
  }
}

TEST(Inference, SimDeviceGivesTheCpuBits) {
  for (PrefillMode mode : {PrefillMode::pass_kv, PrefillMode::pass_q}) {
    Scenario s;
    s.prefill = {80, 50};
    s.chunk = 30;
    s.mode = mode;
    s.mask = parse_mask("causal+documents");
    s.build();
    Scenario sim = s;
    sim.device = DeviceKind::sim;
    for (int p : {1, 3}) {
      const auto a = run_on_threads(s, p), b = run_on_threads(sim, p);
      for (int r = 0; r < p; ++r)
        for (int64_t seq = 0; seq < 2; ++seq) {
          EXPECT_TRUE(test::same_bits(a[r].out[seq], b[r].out[seq]))
              << prefill_mode_name(mode) << " P=" << p;
          EXPECT_TRUE(test::same_bits(a[r].lse[seq], b[r].lse[seq]))
              << prefill_mode_name(mode) << " P=" << p;
        }
    }
  }
}

TEST(Inference, PrefillBytesArePredictedAndTheSmallerModeIsChosen) {
  for (int p : {2, 3, 4}) {
    // A long cache and a short prefill: pass-Q; no cache and a long prefill: pass-KV.
    Scenario s;
    s.prefill = {400};
    s.chunk = 360;  // 360 new against nothing, then 40 new against 360 cached
    s.decode_steps = 1;
    s.build();
    const auto rs = run_on_threads(s, p);
    ASSERT_EQ(rs[0].modes.size(), 2u);
    EXPECT_EQ(rs[0].modes[0], PrefillMode::pass_kv) << "P=" << p;
    EXPECT_EQ(rs[0].modes[1], PrefillMode::pass_q) << "P=" << p;
    for (int call = 0; call < 2; ++call) {
      PrefillShape sh;
      sh.cached = call == 0 ? 0 : 360;
      sh.new_tokens = call == 0 ? 360 : 40;
      sh.ranks = p, sh.hq = s.hq, sh.hkv = s.hkv, sh.head_dim = s.d, sh.block = s.block;
      const PrefillBytes want = predict_prefill_bytes(sh);
      uint64_t sent = 0;
      for (const RankResult& r : rs) sent += r.prefill_stats[call].bytes_sent;
      EXPECT_EQ(sent, call == 0 ? want.pass_kv : want.pass_q) << "P=" << p << " call " << call;
      EXPECT_EQ(choose_prefill(sh), rs[0].modes[call]);
    }
    // Forced modes move what the prediction says, too.
    for (PrefillMode mode : {PrefillMode::pass_kv, PrefillMode::pass_q}) {
      Scenario f = s;
      f.mode = mode;
      const auto fr = run_on_threads(f, p);
      PrefillShape sh;
      sh.cached = 360, sh.new_tokens = 40, sh.ranks = p, sh.hq = s.hq, sh.hkv = s.hkv;
      sh.head_dim = s.d, sh.block = s.block;
      uint64_t sent = 0;
      for (const RankResult& r : fr) sent += r.prefill_stats[1].bytes_sent;
      const PrefillBytes want = predict_prefill_bytes(sh);
      EXPECT_EQ(sent, mode == PrefillMode::pass_kv ? want.pass_kv : want.pass_q);
      EXPECT_EQ(fr[0].modes[1], mode);
    }
  }
}
