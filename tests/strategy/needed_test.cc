// The needed exchange (Exchange::needed) of the ring (src/strategy/ring_needed.cc, docs/ring.md
// "Moving only what is needed") and of the all-gather (src/strategy/allgather.cc,
// docs/allgather.md "Gathering only what is needed"): exact against the fp64 reference, the
// same bits on every run and device timing, and the bytes it reports are exactly the K/V tiles
// some query of the receiving rank can see (counted element by element here, independently of
// classify).
#include <gtest/gtest.h>

#include <numeric>
#include <sstream>

#include "ctxpar/layout.h"
#include "strategy/strategy_support.h"
#include "same_bits.h"

namespace ctxpar::testing {
namespace {

// A packed sequence of long-tailed document lengths (one long, a few medium, several short),
// T odd so that every layout pads.
const std::vector<int64_t> kLengths = {300, 7, 150, 40, 3, 90, 21};  // T = 611

// hkv = 2 gives the all-gather two head groups (allgather_head_groups), each gathered apart.
Problem packed_problem(const char* mask, uint64_t seed, const std::vector<int64_t>& lengths,
                       int64_t hq = 2, int64_t hkv = 1) {
  Problem pr;
  pr.tokens = std::accumulate(lengths.begin(), lengths.end(), int64_t(0));
  pr.hq = hq;
  pr.hkv = hkv;
  pr.d = 16;
  pr.mask = parse_mask(mask);
  pr.seed = seed;  // references are cached by seed: each document split has its own
  pr.build();
  pr.documents.clear();
  for (size_t i = 0; i < lengths.size(); ++i)
    pr.documents.insert(pr.documents.end(), lengths[i], int32_t(i));
  return pr;
}

StrategyOptions needed_options(const Problem& pr, StrategyKind kind = StrategyKind::ring) {
  StrategyOptions opt;
  opt.kind = kind;
  opt.mask = pr.mask;
  opt.exchange = Exchange::needed;
  return opt;
}

void expect_within(const Errors& e, const Errors& bound, const std::string& where) {
  EXPECT_LE(e.o, bound.o) << where;
  EXPECT_LE(e.lse, bound.lse) << where;
  EXPECT_LE(e.dq, bound.dq) << where;
  EXPECT_LE(e.dk, bound.dk) << where;
  EXPECT_LE(e.dv, bound.dv) << where;
}

TEST(Needed, MatchesTheFp64ReferenceForwardAndBackward) {
  const char* const masks[] = {"causal+documents", "window:50,20+documents", "causal"};
  for (size_t mi = 0; mi < 3; ++mi) {
    const Problem pr = packed_problem(masks[mi], 40 + mi, kLengths);
    const References& refs = references_of(pr);
    const Errors bound = bounds_of(refs);  // accuracy_tolerance: 2 x naive fp32 + floor
    for (int p : {2, 3, 4})
      for (LayoutKind lk : {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped}) {
        std::ostringstream where;
        where << "mask=" << masks[mi] << " P=" << p << " layout=" << layout_name(lk);
        expect_within(errors_of(run_sharded(pr, p, lk, needed_options(pr)), refs), bound,
                      where.str());
      }
  }
}

// The all-gather gathers only the needed tiles and computes its queries against them in one
// pass: the masks see true positions (and document ids) carried by the tiles, under packed
// documents and a prefix tree (slices), two head groups gathered apart, P = 2..4.
TEST(Needed, AllGatherMatchesTheFp64ReferenceForwardAndBackward) {
  const char* const masks[] = {"causal+documents", "prefix-tree:211,150,100,90,60"};  // T = 611
  for (size_t mi = 0; mi < 2; ++mi) {
    const Problem pr = packed_problem(masks[mi], 80 + mi, kLengths, 4, 2);
    const References& refs = references_of(pr);
    const Errors bound = bounds_of(refs);  // accuracy_tolerance: 2 x naive fp32 + floor
    for (int p : {2, 3, 4})
      for (LayoutKind lk : {LayoutKind::zigzag, LayoutKind::balanced}) {
        const RunResult res = run_sharded(pr, p, lk, needed_options(pr, StrategyKind::allgather));
        expect_within(
            errors_of(res, refs), bound,
            detail::concat("allgather mask=", masks[mi], " P=", p, " layout=", layout_name(lk)));
      }
  }
}

// Two runs, and a run on the sim device (every operation delayed at random, so messages and
// gradients arrive in another order), give the same bits: the owner adds the gradients that
// come home in a fixed order (the ring: step order; the all-gather: rank order).
TEST(Needed, TheSameBitsOnEveryRunAndTiming) {
  const Problem pr = packed_problem("causal+documents", 40, kLengths);
  for (StrategyKind kind : {StrategyKind::ring, StrategyKind::allgather}) {
    StrategyOptions opt = needed_options(pr, kind);
    const RunResult a = run_sharded(pr, 4, LayoutKind::striped, opt);
    const RunResult b = run_sharded(pr, 4, LayoutKind::striped, opt);
    opt.device.kind = DeviceKind::sim;
    opt.device.sim_seed = 7;
    opt.device.sim_max_delay_us = 50;
    const RunResult c = run_sharded(pr, 4, LayoutKind::striped, opt);
    for (const RunResult* r : {&b, &c}) {
      EXPECT_TRUE(test::same_bits(a.o, r->o)) << strategy_name(kind);
      EXPECT_TRUE(test::same_bits(a.lse, r->lse)) << strategy_name(kind);
      EXPECT_TRUE(test::same_bits(a.dq, r->dq)) << strategy_name(kind);
      EXPECT_TRUE(test::same_bits(a.dk, r->dk)) << strategy_name(kind);
      EXPECT_TRUE(test::same_bits(a.dv, r->dv)) << strategy_name(kind);
    }
  }
}

// The rows of `owner`'s block that `reader` needs, counted without classify: a 64-row tile
// of the owner's shard travels when some (query, key) pair of the two shards is visible
// (Mask::visible, element by element, padding included as the ranks hold it).
int64_t needed_rows(const Problem& pr, const Layout& layout, int owner, int reader) {
  const std::vector<int64_t> kp = layout.token_positions(owner),
                             qp = layout.token_positions(reader);
  const std::vector<int32_t> kd = layout.shard(pr.documents, owner),
                             qd = layout.shard(pr.documents, reader);
  const int64_t tl = layout.local_tokens();
  int64_t rows = 0;
  for (int64_t t0 = 0; t0 < tl; t0 += kKernelTile) {
    const int64_t t1 = std::min(tl, t0 + kKernelTile);
    bool seen = false;
    for (int64_t j = t0; j < t1 && !seen; ++j)
      for (int64_t i = 0; i < tl && !seen; ++i) seen = pr.mask.visible(qp[i], kp[j], qd[i], kd[j]);
    if (seen) rows += t1 - t0;
  }
  return rows;
}

// Contiguous shards hold runs of consecutive positions (and document ids), for which a tile
// classify does not skip always has a visible pair: the tile-level rule is then exactly the
// element-level one above, and so must the reported bytes be. The all-gather sends each needed
// row once to each reader as the ring does (its backward gathers again), with the token ids
// once per head group.
void check_bytes(const Problem& pr, int p, bool expect_zero,
                 StrategyKind kind = StrategyKind::ring) {
  const Layout layout(LayoutKind::contiguous, pr.tokens, p);
  const RunResult res = run_sharded(pr, p, LayoutKind::contiguous, needed_options(pr, kind));
  const int64_t tl = layout.local_tokens(), tiles = (tl + kKernelTile - 1) / kKernelTile;
  const uint64_t groups = kind == StrategyKind::allgather ? allgather_head_groups(pr.hkv, 0) : 1;
  const uint64_t kv_row = 2 * pr.batch * pr.hkv * pr.d * dtype_size(pr.dtype) +
                          groups * (8 + (pr.mask.documents ? 4 : 0));  // k, v, position, document
  const uint64_t grad_row = 2 * pr.batch * pr.hkv * pr.d * 4;          // fp32 dk, dv
  const uint64_t summaries = uint64_t(p - 1) * tiles * sizeof(TileRange);  // all-gathered
  for (int r = 0; r < p; ++r) {
    uint64_t out = 0, in = 0;  // rows this rank sends / receives
    for (int o = 0; o < p; ++o)
      if (o != r) out += needed_rows(pr, layout, r, o), in += needed_rows(pr, layout, o, r);
    const std::string where =
        detail::concat(strategy_name(kind), " P=", p, " rank ", r, " mask=", pr.mask.describe());
    if (expect_zero) {
      EXPECT_EQ(out + in, 0u) << where;
    }
    EXPECT_EQ(res.forward_stats[r].bytes_sent, summaries + out * kv_row) << where;
    EXPECT_EQ(res.forward_stats[r].bytes_received, summaries + in * kv_row) << where;
    EXPECT_EQ(res.backward_stats[r].bytes_sent, summaries + out * kv_row + in * grad_row) << where;
    EXPECT_EQ(res.backward_stats[r].bytes_received, summaries + in * kv_row + out * grad_row)
        << where;
  }
}

TEST(Needed, ReportsExactlyTheBytesOfTheTilesAPeerCanSee) {
  for (int p : {2, 3, 4}) {
    check_bytes(packed_problem("causal+documents", 40, kLengths), p, false);
    check_bytes(packed_problem("causal", 42, kLengths), p, false);
  }
  // Every document on one rank (documents cut at the shards of a contiguous layout): no K/V
  // moves at all, only the tile summaries.
  check_bytes(packed_problem("causal+documents", 50, {100, 30, 130, 60, 70, 1, 129}), 4, true);
}

// The all-gather's bytes, two head groups: a pair of ranks with nothing visible moves nothing
// (the ranks whose documents end before a peer's begin), the others exactly the needed tiles.
TEST(Needed, AllGatherReportsExactlyTheBytesOfTheTilesItNeeds) {
  for (int p : {2, 3, 4})
    check_bytes(packed_problem("causal+documents", 80, kLengths, 4, 2), p, false,
                StrategyKind::allgather);
  check_bytes(packed_problem("causal+documents", 51, {100, 30, 130, 60, 70, 1, 129}, 4, 2), 4, true,
              StrategyKind::allgather);
}

TEST(Needed, AutoPicksItForTheRingAndAllGatherUnderADocumentsOrSliceMaskOnly) {
  auto resolved = [](StrategyKind kind, const char* mask, Exchange asked) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = parse_mask(mask);
    opt.exchange = asked;
    Exchange got = Exchange::automatic;
    run_threads(1,
                [&](Communicator& comm) { got = Strategy::create(comm, opt)->options().exchange; });
    return got;
  };
  EXPECT_EQ(resolved(StrategyKind::ring, "causal+documents", Exchange::automatic),
            Exchange::needed);
  EXPECT_EQ(resolved(StrategyKind::ring, "causal", Exchange::automatic), Exchange::ring);
  EXPECT_EQ(resolved(StrategyKind::ring, "window:8,4", Exchange::automatic), Exchange::ring);
  EXPECT_EQ(resolved(StrategyKind::ring, "causal+documents", Exchange::ring), Exchange::ring);
  EXPECT_EQ(resolved(StrategyKind::ring, "causal", Exchange::needed), Exchange::needed);
  EXPECT_EQ(resolved(StrategyKind::allgather, "causal+documents", Exchange::automatic),
            Exchange::needed);
  EXPECT_EQ(resolved(StrategyKind::allgather, "prefix-tree:8,4,4", Exchange::automatic),
            Exchange::needed);
  EXPECT_EQ(resolved(StrategyKind::allgather, "causal", Exchange::automatic), Exchange::ring);
  EXPECT_EQ(resolved(StrategyKind::allgather, "window:8,4", Exchange::automatic), Exchange::ring);
  for (StrategyKind k : {StrategyKind::ulysses, StrategyKind::hybrid})
    EXPECT_EQ(resolved(k, "causal+documents", Exchange::automatic), Exchange::ring);
  EXPECT_EQ(parse_exchange("needed"), Exchange::needed);
  EXPECT_EQ(std::string(exchange_name(parse_exchange("auto"))), "auto");
  try {
    parse_exchange("sparse");
    ADD_FAILURE() << "an unknown exchange was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use auto, ring or needed"), std::string::npos)
        << e.what();
  }
}

TEST(Needed, OtherStrategiesRefuseItOnEveryRankNamingWhatWorks) {
  for (StrategyKind kind : {StrategyKind::ulysses, StrategyKind::hybrid}) {
    StrategyOptions opt;
    opt.kind = kind;
    opt.mask = parse_mask("causal+documents");
    opt.exchange = Exchange::needed;
    const std::vector<std::string> errors =
        errors_on_ranks(2, [&](Communicator& comm) { Strategy::create(comm, opt); });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("exchange = needed"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find("strategy = ring or allgather"), std::string::npos) << errors[r];
    }
  }
}

}  // namespace
}  // namespace ctxpar::testing
