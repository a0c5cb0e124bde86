#include "layout/balance.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>

#include "ctxpar/error.h"

namespace ctxpar {

namespace {

// Whole pieces hold at most a quarter of a rank's work and chunks: larger ones left the fillers
// too little room to even the ranks out (busiest / mean 1.3-1.6 with halves on packed
// long-tailed documents), smaller ones cut more short documents (tests/layout/balanced_test.cc).
constexpr int kWholeDivisor = 4;
constexpr int kMaxSwaps = 256;
// The chunk search stops when no swap helps (40-220 swaps a pass at T 128K, P 8); this bound,
// swaps per pass per chunk, only caps its time on adversarial input.
constexpr int64_t kMaxSwapsPerChunk = 1;

// The position / document range of chunk i (mask_rules.h's TileRange), padding left out.
TileRange chunk_range(const BalanceInput& b, int64_t tokens, int64_t c, int64_t i) {
  std::vector<int64_t> index(static_cast<size_t>(c));
  for (int64_t t = 0; t < c; ++t) index[size_t(t)] = i * c + t;
  return tokens_range(b, tokens, index);
}

}  // namespace

TileRange tokens_range(const BalanceInput& b, int64_t tokens, std::span<const int64_t> index) {
  TileRange r;
  r.pos_lo = kInt64Max, r.pos_hi = kInt64Min;
  r.doc_lo = std::numeric_limits<int32_t>::max(), r.doc_hi = std::numeric_limits<int32_t>::min();
  int64_t real = 0;
  for (int64_t t : index) {
    if (t >= tokens) continue;  // padding
    ++real;
    const int64_t p = b.positions.empty() ? t : b.positions[size_t(t)];
    r.pos_lo = std::min(r.pos_lo, p), r.pos_hi = std::max(r.pos_hi, p);
    if (b.mask.documents) {
      const int32_t d = b.documents[size_t(t)];
      r.doc_lo = std::min(r.doc_lo, d), r.doc_hi = std::max(r.doc_hi, d);
    }
  }
  r.padding = real == 0                      ? TileRange::all
              : real < int64_t(index.size()) ? TileRange::some
                                             : TileRange::none;
  if (!b.mask.documents) r.doc_lo = r.doc_hi = 0;
  return r;
}

std::vector<TileRange> chunk_ranges(const BalanceInput& b, int64_t tokens, int64_t padded,
                                    int64_t c) {
  CTXPAR_CHECK(b.positions.empty() || int64_t(b.positions.size()) == tokens,
               "balanced layout: ", b.positions.size(), " positions for T = ", tokens, " tokens");
  CTXPAR_CHECK(!b.mask.documents || int64_t(b.documents.size()) == tokens,
               "balanced layout: the mask uses documents and needs one document id per token (T = ",
               tokens, "), got ", b.documents.size());
  const int64_t n = (padded + c - 1) / c;  // the last chunk may be short (rank_work's layouts)
  std::vector<TileRange> ranges(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) ranges[size_t(i)] = chunk_range(b, tokens, c, i);
  return ranges;
}

ChunkCosts chunk_costs(const BalanceInput& b, int64_t tokens, int64_t padded, int64_t c) {
  const std::vector<TileRange> ranges = chunk_ranges(b, tokens, padded, c);
  const int64_t n = int64_t(ranges.size());
  ChunkCosts out;
  out.size = c;
  out.work.assign(size_t(n), 0.0);
  out.pairs.assign(size_t(n), 0.0);
  out.first.assign(size_t(n), n);
  out.last.assign(size_t(n), -1);
  // The visible pairs of a partial tile, element by element (Mask::visible; padding sees and
  // is seen by nothing).
  std::vector<int64_t> pos(static_cast<size_t>(n * c), kPaddingPosition);
  std::vector<int32_t> doc(static_cast<size_t>(n * c), 0);
  for (int64_t t = 0; t < std::min(tokens, n * c); ++t) {
    pos[size_t(t)] = b.positions.empty() ? t : b.positions[size_t(t)];
    if (b.mask.documents) doc[size_t(t)] = b.documents[size_t(t)];
  }
  auto count = [&](int64_t i, int64_t j) {
    int64_t pairs = 0;
    for (int64_t q = i * c; q < (i + 1) * c; ++q)
      for (int64_t k = j * c; k < (j + 1) * c; ++k)
        pairs += b.mask.visible(pos[size_t(q)], pos[size_t(k)], doc[size_t(q)], doc[size_t(k)]);
    return double(pairs);
  };
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      const TileKind kind = classify(b.mask, ranges[size_t(i)], ranges[size_t(j)]);
      if (kind == TileKind::skip) continue;
      out.work[size_t(i)] += double(c) * double(c);
      out.pairs[size_t(i)] += kind == TileKind::full ? double(c) * double(c) : count(i, j);
      out.first[size_t(i)] = std::min(out.first[size_t(i)], j);
      out.last[size_t(i)] = j;
    }
  return out;
}

std::vector<int32_t> balance_chunks(const ChunkCosts& costs, int ranks) {
  const int64_t n = int64_t(costs.work.size());
  CTXPAR_CHECK(ranks >= 1 && n % ranks == 0, "balanced layout: ", n, " chunks over ", ranks,
               " ranks");
  const int64_t share = n / ranks;  // chunks per rank
  double total = 0;
  for (double w : costs.work) total += w;
  const double target = total / ranks;

  // Groups: runs of chunks that see back to the same first key chunk, i.e. one document (or
  // prefix tree, or any mask's connected run) each, a chunk shared by two documents going with
  // the earlier one. A group with at most 1/kWholeDivisor of a rank's work and chunks is short:
  // runs of short groups become whole pieces of up to that size (a cut between two pieces splits
  // the one document that straddles that chunk boundary). A longer group is split head-tail into pairs
  // of chunks (i, n-1-i: equal work under a causal mask), the fine-grained fillers that even
  // out what the whole pieces leave.
  struct Piece {
    std::vector<int64_t> chunks;
    double work = 0;
  };
  const double cap_work = target / kWholeDivisor;
  const int64_t cap_chunks = std::max<int64_t>(1, share / kWholeDivisor);
  std::vector<Piece> whole, fillers;
  Piece run;  // the short groups not yet closed into a piece
  auto close_run = [&] {
    if (!run.chunks.empty()) whole.push_back(std::move(run));
    run = {};
  };
  for (int64_t b = 0; b < n;) {
    int64_t e = b + 1;
    while (e < n && costs.first[size_t(e)] == costs.first[size_t(b)]) ++e;
    double w = 0;
    for (int64_t i = b; i < e; ++i) w += costs.work[size_t(i)];
    if (w <= cap_work && e - b <= cap_chunks) {
      if (run.work + w > cap_work || int64_t(run.chunks.size()) + (e - b) > cap_chunks) close_run();
      for (int64_t i = b; i < e; ++i) run.chunks.push_back(i);
      run.work += w;
    } else {
      close_run();
      // k head-tail pieces of about half a rank's work each (and at most half its chunks): run j
      // of 2k equal runs with run 2k-1-j. Few ranks share a long document, so few need its K/V
      // (pairs of single chunks spread every long document over every rank: each then needed
      // the K/V of all of it).
      const int64_t len = e - b;
      int64_t k = std::max<int64_t>(int64_t(std::ceil(w / std::max(cap_work * 2, 1e-300))),
                                    (len + cap_chunks * 2 - 1) / (cap_chunks * 2));
      k = std::clamp<int64_t>(k, 1, std::max<int64_t>(1, len / 2));
      for (int64_t j = 0; j < k; ++j) {
        Piece piece;
        for (int64_t run : {j, 2 * k - 1 - j})
          for (int64_t i = b + len * run / (2 * k); i < b + len * (run + 1) / (2 * k); ++i)
            piece.chunks.push_back(i), piece.work += costs.work[size_t(i)];
        fillers.push_back(std::move(piece));
      }
    }
    b = e;
  }
  close_run();
  auto by_work = [](const Piece& a, const Piece& b) { return a.work > b.work; };
  std::stable_sort(fillers.begin(), fillers.end(), by_work);

  std::vector<int32_t> owner(size_t(n), -1);
  std::vector<double> load(size_t(ranks), 0.0);
  std::vector<int64_t> room(size_t(ranks), share);
  std::vector<Piece> placed;  // every piece as placed, its rank in `at`
  std::vector<int> at;
  auto put = [&](const std::vector<int64_t>& chunks, double work, int r) {
    load[size_t(r)] += work, room[size_t(r)] -= int64_t(chunks.size());
    placed.push_back({chunks, work}), at.push_back(r);
  };
  // The least loaded rank with room for `size` chunks (ties: the lowest rank); -1 if none.
  auto least_loaded = [&](int64_t size) {
    int best = -1;
    for (int r = 0; r < ranks; ++r)
      if (room[size_t(r)] >= size && (best < 0 || load[size_t(r)] < load[size_t(best)])) best = r;
    return best;
  };

  // Whole pieces first. Fillers will take every chunk of room left, bringing about `density`
  // work a chunk, so a rank ends near load + room * density: whole pieces are placed to even out
  // that projection (a piece of many cheap tokens lowers it, a dense one raises it), largest
  // effect first. Without fillers, largest work first on the least loaded rank.
  double filler_work = 0;
  int64_t filler_chunks = 0;
  for (const Piece& f : fillers) filler_work += f.work, filler_chunks += int64_t(f.chunks.size());
  const double density = filler_chunks > 0 ? filler_work / double(filler_chunks) : 0;
  auto effect = [&](const Piece& p) { return p.work - double(p.chunks.size()) * density; };
  std::stable_sort(whole.begin(), whole.end(), [&](const Piece& a, const Piece& b) {
    return filler_chunks > 0 ? std::abs(effect(a)) > std::abs(effect(b)) : a.work > b.work;
  });
  std::vector<Piece> split;  // whole pieces that found no room, placed chunk by chunk below
  for (Piece& p : whole) {
    const int64_t size = int64_t(p.chunks.size());
    int best = -1;
    double best_proj = 0;
    const bool raises = effect(p) >= 0;  // to the lowest projection, else to the highest
    for (int r = 0; r < ranks; ++r) {
      if (room[size_t(r)] < size) continue;
      const double proj = load[size_t(r)] + double(room[size_t(r)]) * density;
      if (best < 0 || (raises ? proj < best_proj : proj > best_proj)) best = r, best_proj = proj;
    }
    if (filler_chunks == 0) best = least_loaded(size);
    if (best >= 0)
      put(p.chunks, p.work, best);
    else
      split.push_back(std::move(p));
  }
  for (const Piece& f : fillers) {
    const int r = least_loaded(int64_t(f.chunks.size()));
    if (r >= 0) {
      put(f.chunks, f.work, r);
    } else {
      split.push_back(f);
    }
  }
  for (const Piece& p : split)
    for (int64_t i : p.chunks) put({i}, costs.work[size_t(i)], least_loaded(1));  // room for one

  // Refinement: while some swap of two pieces of one size between the busiest and the least
  // loaded rank lowers the busier of the two, make the best such swap (bounded, deterministic).
  // The greedy placement leaves 1.1-1.2 on some batches (a last whole piece with nowhere good to
  // go); a few swaps bring them to the fillers' granularity.
  for (int iter = 0; iter < kMaxSwaps; ++iter) {
    const int a = int(std::max_element(load.begin(), load.end()) - load.begin());
    const int b = int(std::min_element(load.begin(), load.end()) - load.begin());
    double best = load[size_t(a)];
    size_t bx = 0, by = 0;
    for (size_t x = 0; x < placed.size(); ++x) {
      if (at[x] != a) continue;
      for (size_t y = 0; y < placed.size(); ++y) {
        if (at[y] != b || placed[y].chunks.size() != placed[x].chunks.size()) continue;
        const double d = placed[x].work - placed[y].work;
        const double worse = std::max(load[size_t(a)] - d, load[size_t(b)] + d);
        if (d > 0 && worse < best) best = worse, bx = x, by = y;
      }
    }
    if (best >= load[size_t(a)]) break;
    const double d = placed[bx].work - placed[by].work;
    load[size_t(a)] -= d, load[size_t(b)] += d;
    std::swap(at[bx], at[by]);
  }
  for (size_t x = 0; x < placed.size(); ++x)
    for (int64_t i : placed[x].chunks) owner[size_t(i)] = at[x];
  // Then single chunks, the finest grain: a local search that, while some swap of a chunk of the
  // busiest rank with a chunk of any other rank lowers the busiest rank and leaves the other
  // below it, makes the swap that leaves the lower maximum of the two (the first such in rank and
  // chunk order: deterministic), until no swap helps. Stopping at a fixed 1.01 / 1.03 of the mean
  // instead left 1.008-1.037 where torch's per-document head-tail reaches 1.000-1.009
  // (bench/data_aware.py); the search reaches 1.000 in tiles.
  // Its passes, cheapest in bytes first: 0 moves a chunk only to a rank that already fetches its
  // K/V (it holds a later chunk of the same group), 1 only to a rank that holds part of its group
  // (a late chunk of a long document moved to a rank without it made that rank fetch the whole
  // document: 0.41 -> 0.55 of the striped ring's bytes), 2 anywhere, for what 0 and 1 leave
  // (without it: up to 1.056 on some batches). Group: the first key chunk a chunk sees.
  std::vector<int32_t> held(size_t(n) * size_t(ranks), 0);  // chunks of group g on rank r
  auto group = [&](int64_t i) { return std::min<int64_t>(costs.first[size_t(i)], i); };
  for (int64_t i = 0; i < n; ++i)
    ++held[size_t(group(i)) * size_t(ranks) + size_t(owner[size_t(i)])];
  auto has = [&](int64_t i, int r) {
    return held[size_t(group(i)) * size_t(ranks) + size_t(r)] > 0;
  };
  // The last chunk of group g on rank r (-1: none): under a causal mask a rank that holds a later
  // chunk of a document fetches (or holds) the K/V of every earlier one already.
  std::vector<int64_t> last_on(size_t(n) * size_t(ranks), -1);
  for (int64_t i = 0; i < n; ++i)
    last_on[size_t(group(i)) * size_t(ranks) + size_t(owner[size_t(i)])] = i;
  auto find_last = [&](int64_t g, int r) {
    int64_t i = n - 1;
    while (i >= g && !(owner[size_t(i)] == r && group(i) == g)) --i;
    last_on[size_t(g) * size_t(ranks) + size_t(r)] = i >= g ? i : -1;
  };
  auto fetches = [&](int64_t i, int r) {
    return last_on[size_t(group(i)) * size_t(ranks) + size_t(r)] > i;
  };
  std::vector<std::vector<int64_t>> mine(static_cast<size_t>(ranks));  // each rank's chunks
  for (int64_t i = 0; i < n; ++i) mine[size_t(owner[size_t(i)])].push_back(i);
  // Tiles first (what the kernel computes: they set the step time), then visible pairs, by swaps
  // of chunks of equal tiles (every rank's tiles stay as they are) in pass 0 only: pass 1 for
  // pairs gained <= 0.007 in pairs but split more short documents (14 of 29 whole instead of 17,
  // T 64K, P 8) and moved 0.09 -> 0.11 of the striped ring's bytes (T 128K, P 4).
  std::vector<double> pair_load(size_t(ranks), 0.0);
  for (int64_t i = 0; i < n; ++i) pair_load[size_t(owner[size_t(i)])] += costs.pairs[size_t(i)];
  for (bool by_pairs : {false, true})
    for (int pass = 0; pass < (by_pairs ? 1 : 3); ++pass) {
      const std::vector<double>& cost = by_pairs ? costs.pairs : costs.work;
      std::vector<double>& at_rank = by_pairs ? pair_load : load;
      for (int64_t iter = 0; iter < kMaxSwapsPerChunk * n; ++iter) {
        const int a = int(std::max_element(at_rank.begin(), at_rank.end()) - at_rank.begin());
        double best = at_rank[size_t(a)];
        int b = -1;
        size_t bx = 0, by = 0;
        for (int r = 0; r < ranks; ++r) {
          const double gap = at_rank[size_t(a)] - at_rank[size_t(r)];
          if (r == a || gap <= 0) continue;
          for (size_t x = 0; x < mine[size_t(a)].size(); ++x) {
            const int64_t cx = mine[size_t(a)][x];
            if ((pass == 0 && !fetches(cx, r)) || (pass == 1 && !has(cx, r))) continue;
            for (size_t y = 0; y < mine[size_t(r)].size(); ++y) {
              const int64_t cy = mine[size_t(r)][y];
              const double d = cost[size_t(cx)] - cost[size_t(cy)];
              if (d <= 0 || d >= gap || (pass == 0 && !fetches(cy, a)) ||
                  (pass == 1 && !has(cy, a)) ||
                  (by_pairs && costs.work[size_t(cx)] != costs.work[size_t(cy)]))
                continue;
              const double worse = std::max(at_rank[size_t(a)] - d, at_rank[size_t(r)] + d);
              if (worse < best) best = worse, b = r, bx = x, by = y;
            }
          }
        }
        if (b < 0) break;
        const int64_t cx = mine[size_t(a)][bx], cy = mine[size_t(b)][by];
        for (auto [i, from, to] : {std::tuple{cx, a, b}, std::tuple{cy, b, a}}) {
          load[size_t(from)] -= costs.work[size_t(i)], load[size_t(to)] += costs.work[size_t(i)];
          pair_load[size_t(from)] -= costs.pairs[size_t(i)];
          pair_load[size_t(to)] += costs.pairs[size_t(i)];
          owner[size_t(i)] = to;
          --held[size_t(group(i)) * size_t(ranks) + size_t(from)];
          ++held[size_t(group(i)) * size_t(ranks) + size_t(to)];
        }
        std::swap(mine[size_t(a)][bx], mine[size_t(b)][by]);
        for (int64_t i : {cx, cy})
          for (int r : {a, b}) find_last(group(i), r);
      }
    }
  return owner;
}

}  // namespace ctxpar
