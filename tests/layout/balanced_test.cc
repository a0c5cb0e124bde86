// The balanced layout: a partition like every layout (each token once, equal shares, increasing
// local order, permutation and inverse), deterministic, its work model checked by brute force,
// and its balance on packed long-tailed documents and on a prefix tree.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "ctxpar/layout.h"
#include "layout/balance.h"

namespace ctxpar {
namespace {

// Packed documents of long-tailed lengths: log-normal (median 1,000 tokens, sigma 1.5, within
// [32, 32,768]), the shape reported for web and code corpora (many short documents, a few that
// hold most of the tokens); the last one cut to fill T.
std::vector<int64_t> long_tailed(int64_t tokens, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::lognormal_distribution<double> len(std::log(1000.0), 1.5);
  std::vector<int64_t> out;
  int64_t sum = 0;
  while (sum < tokens) {
    const int64_t l = std::min(tokens - sum, std::clamp<int64_t>(int64_t(len(rng)), 32, 32768));
    out.push_back(l), sum += l;
  }
  return out;
}

std::vector<int32_t> ids_of(const std::vector<int64_t>& lengths) {
  std::vector<int32_t> ids;
  for (size_t d = 0; d < lengths.size(); ++d) ids.insert(ids.end(), lengths[d], int32_t(d));
  return ids;
}

double busiest_over_mean(const std::vector<double>& w) {
  const double mean = std::accumulate(w.begin(), w.end(), 0.0) / double(w.size());
  return *std::max_element(w.begin(), w.end()) / mean;
}

TEST(Balanced, IsAPartitionWithItsPermutation) {
  for (int p : {1, 2, 3, 4}) {
    for (int64_t t : {5, 45, 300, 1000}) {
      const std::vector<int64_t> lengths = long_tailed(t, uint64_t(t + p));
      const std::vector<int32_t> ids = ids_of(lengths);
      const Layout l(LayoutKind::balanced, t, p, {parse_mask("causal+documents"), ids, {}});
      EXPECT_EQ(l.padded_tokens() % (balanced_chunk(t, p) * p), 0);
      std::vector<int> seen(static_cast<size_t>(l.padded_tokens()), 0);
      for (int r = 0; r < p; ++r) {
        const std::vector<int64_t> pos = l.positions(r);
        ASSERT_EQ(int64_t(pos.size()), l.local_tokens());
        EXPECT_TRUE(std::is_sorted(pos.begin(), pos.end()));
        for (size_t i = 0; i < pos.size(); ++i) {
          ++seen[size_t(pos[i])];
          EXPECT_EQ(l.owner(pos[i]), r);
          EXPECT_EQ(l.local_index(pos[i]), int64_t(i));
        }
      }
      for (int n : seen) EXPECT_EQ(n, 1);
      const std::vector<int64_t> perm = l.permutation(), inv = l.inverse_permutation();
      for (size_t slot = 0; slot < perm.size(); ++slot)
        EXPECT_EQ(inv[size_t(perm[slot])], int64_t(slot));
      // Per-token arrays round-trip through shard / unshard.
      std::vector<int64_t> full(static_cast<size_t>(t));
      std::iota(full.begin(), full.end(), 100);
      std::vector<std::vector<int64_t>> shards;
      for (int r = 0; r < p; ++r) shards.push_back(l.shard(full, r, int64_t(-1)));
      EXPECT_EQ(l.unshard(shards), full);
    }
  }
}

TEST(Balanced, SameInputSameAssignment) {
  const std::vector<int32_t> ids = ids_of(long_tailed(8192, 3));
  const BalanceInput in{parse_mask("causal+documents"), ids, {}};
  EXPECT_EQ(Layout(LayoutKind::balanced, 8192, 4, in).permutation(),
            Layout(LayoutKind::balanced, 8192, 4, in).permutation());
}

// rank_work against its definition: c * c for every (query chunk, key chunk) pair in which some
// pair of tokens is visible, summed over the rank's query chunks (Mask::visible, brute force).
TEST(Balanced, WorkModelMatchesBruteForce) {
  const int64_t t = 300;
  const int p = 3;
  const std::vector<int32_t> ids = ids_of({120, 7, 50, 123});
  for (const char* text : {"causal+documents", "documents", "causal", "prefix-tree:100,100,100"}) {
    const Mask m = parse_mask(text);
    const BalanceInput in{
        m, m.documents ? std::span<const int32_t>(ids) : std::span<const int32_t>{}, {}};
    const Layout l(LayoutKind::balanced, t, p, in);
    const int64_t c = balanced_chunk(t, p), n = l.padded_tokens() / c;
    std::vector<double> want(static_cast<size_t>(p), 0.0);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        bool any = false;
        for (int64_t a = i * c; a < (i + 1) * c && a < t && !any; ++a)
          for (int64_t b = j * c; b < (j + 1) * c && b < t && !any; ++b)
            any =
                m.visible(a, b, m.documents ? ids[size_t(a)] : 0, m.documents ? ids[size_t(b)] : 0);
        if (any) want[size_t(l.owner(i * c))] += double(c * c);
      }
    EXPECT_EQ(l.rank_work(in), want) << text;
  }
}

// The solver's visible pairs per chunk (what it evens out after the tiles) against a count
// element by element with Mask::visible, padding included (T = 300 pads to 384 at P = 3).
TEST(Balanced, PairsMatchAnElementCount) {
  const int64_t t = 300, c = balanced_chunk(t, 3),
                padded = layout_padded_tokens(LayoutKind::balanced, t, 3);
  const std::vector<int32_t> ids = ids_of({120, 7, 50, 123});
  for (const char* text :
       {"causal+documents", "documents", "causal+window:40,0", "prefix-tree:100,100,100"}) {
    const Mask m = parse_mask(text);
    const BalanceInput in{
        m, m.documents ? std::span<const int32_t>(ids) : std::span<const int32_t>{}, {}};
    const ChunkCosts costs = chunk_costs(in, t, padded, c);
    for (int64_t i = 0; i < padded / c; ++i) {
      double want = 0;
      for (int64_t a = i * c; a < (i + 1) * c && a < t; ++a)
        for (int64_t b = 0; b < t; ++b)
          want +=
              m.visible(a, b, m.documents ? ids[size_t(a)] : 0, m.documents ? ids[size_t(b)] : 0);
      EXPECT_EQ(costs.pairs[size_t(i)], want) << text << " chunk " << i;
    }
  }
}

// What the needed exchange brings each rank (the planner's bytes): every tile of a peer's local
// block that some tile of this rank's queries can see, against a count element by element with
// Mask::visible (no classify), for every layout.
TEST(Balanced, NeededRowsMatchAnElementCount) {
  const int64_t t = 300;
  const int p = 3;
  const std::vector<int32_t> ids = ids_of({120, 7, 50, 123});
  for (const char* text : {"causal+documents", "causal", "prefix-tree:100,100,100"}) {
    const Mask m = parse_mask(text);
    const BalanceInput in{
        m, m.documents ? std::span<const int32_t>(ids) : std::span<const int32_t>{}, {}};
    for (LayoutKind kind :
         {LayoutKind::contiguous, LayoutKind::zigzag, LayoutKind::striped, LayoutKind::balanced})
      for (int64_t tile : {16, 64}) {
        const Layout l(kind, t, p, in);
        const int64_t local = l.local_tokens();
        std::vector<int64_t> want(static_cast<size_t>(p), 0);
        for (int r = 0; r < p; ++r)
          for (int s = 0; s < p; ++s) {
            if (s == r) continue;
            const std::vector<int64_t> qs = l.positions(r), ks = l.positions(s);
            for (int64_t k0 = 0; k0 < local; k0 += tile) {
              const int64_t k1 = std::min(local, k0 + tile);
              bool any = false;
              for (int64_t a : qs)
                for (int64_t i = k0; i < k1 && !any && a < t; ++i) {
                  const int64_t b = ks[size_t(i)];
                  any = b < t && m.visible(a, b, m.documents ? ids[size_t(a)] : 0,
                                           m.documents ? ids[size_t(b)] : 0);
                }
              if (any) want[size_t(r)] += k1 - k0;
            }
          }
        // The exchange decides by tile summaries (position and document ranges): exact where
        // a tile's tokens are contiguous (the contiguous layout), never less than the element
        // count, never more than the ring's (P - 1) Tl.
        const std::vector<int64_t> got = l.needed_rows(in, tile);
        const std::string where =
            std::string(text) + " " + layout_name(kind) + " " + std::to_string(tile);
        if (kind == LayoutKind::contiguous) {
          EXPECT_EQ(got, want) << where;
        }
        for (int r = 0; r < p; ++r) {
          EXPECT_GE(got[size_t(r)], want[size_t(r)]) << where;
          EXPECT_LE(got[size_t(r)], (p - 1) * local) << where;
        }
      }
  }
}

TEST(Balanced, EvensLongTailedDocumentsAndKeepsShortOnesWhole) {
  for (auto [t, p] : {std::pair<int64_t, int>{65536, 4}, {65536, 8}, {131072, 8}}) {
    const std::vector<int64_t> lengths = long_tailed(t, 5);
    const std::vector<int32_t> ids = ids_of(lengths);
    const BalanceInput in{parse_mask("causal+documents"), ids, {}};
    const Layout l(LayoutKind::balanced, t, p, in);
    // Kernel tiles (rank_work, what sets the step time) within 0.5 % of the mean, visible pairs
    // within 2 % (counted token by token: a query sees the keys of its document up to itself).
    // Achieved on bench/data_aware.py's batches (24 of them, T 64K and 128K, P 4 and 8): tiles
    // <= 1.0001, pairs <= 1.014; torch 2.15's per-document head-tail: tiles <= 1.024. The search
    // that stopped at 1.01 / 1.03 left 1.009-1.029 in tiles.
    const double tiles = busiest_over_mean(l.rank_work(in));
    const double zigzag = busiest_over_mean(Layout(LayoutKind::zigzag, t, p).rank_work(in));
    EXPECT_LE(tiles, 1.005) << "T " << t << " P " << p << " (zigzag " << zigzag << ")";
    std::vector<double> pairs(static_cast<size_t>(p), 0.0);
    for (int64_t x = 0, start = 0; x < t; ++x) {
      if (x > 0 && ids[size_t(x)] != ids[size_t(x - 1)]) start = x;
      pairs[size_t(l.owner(x))] += double(x - start + 1);
    }
    EXPECT_LE(busiest_over_mean(pairs), 1.02) << "T " << t << " P " << p;
    // Short documents (up to 1,024 tokens) mostly stay on one rank: they need no K/V from
    // elsewhere. Chunks are 64 tokens and documents do not start at chunk boundaries, so a cut
    // between two whole pieces splits the one document across it, and the last swaps (any chunk
    // anywhere, where the cheaper ones leave the ranks uneven) split a few more: over half stay
    // whole (17 of 29 at T 64K, P 8; the bytes below are what that buys).
    int64_t short_docs = 0, whole = 0, start = 0;
    for (int64_t len : lengths) {
      if (len <= 1024) {
        ++short_docs;
        bool one = true;
        for (int64_t x = start; x < start + len; ++x) one = one && l.owner(x) == l.owner(start);
        whole += one;
      }
      start += len;
    }
    EXPECT_GE(short_docs, 20);
    EXPECT_GE(double(whole), 0.55 * double(short_docs)) << "T " << t << " P " << p;
    // What that buys: the remote key chunks each rank's queries see (what the needed exchange
    // moves, by chunk), at most half of what a ring moves (every remote token to every rank).
    const int64_t c = balanced_chunk(t, p), n = l.padded_tokens() / c;
    int64_t remote = 0;
    for (int r = 0; r < p; ++r)
      for (int64_t j = 0; j < n; ++j) {
        if (l.owner(j * c) == r) continue;
        bool needed = false;
        for (int64_t i = 0; i < n && !needed; ++i) {
          if (l.owner(i * c) != r) continue;
          // causal + documents: some key of chunk j at or before some query of chunk i, and a
          // document in both (ids are increasing along the sequence)
          needed = j <= i && ids[size_t(j * c + c - 1)] >= ids[size_t(i * c)];
        }
        remote += needed ? c : 0;
      }
    EXPECT_LE(double(remote), 0.5 * double(p - 1) * double(t)) << "T " << t << " P " << p;
  }
}

TEST(Balanced, EvensAPrefixTree) {
  // An 8K prompt and eight 2K responses: 1.000 in tiles at P = 4 and 8 (the search that stopped
  // at 1.01 of the mean left 1.009 at one of them).
  const Mask m = parse_mask("prefix-tree:8192,2048,2048,2048,2048,2048,2048,2048,2048");
  for (int p : {4, 8}) {
    const BalanceInput in{m, {}, {}};
    EXPECT_LE(busiest_over_mean(Layout(LayoutKind::balanced, 24576, p, in).rank_work(in)), 1.005);
  }
}

}  // namespace
}  // namespace ctxpar
