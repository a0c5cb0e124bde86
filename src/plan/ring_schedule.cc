// The ring, modelled: how many score pairs each (query rank, key rank) pair computes under a
// layout and mask, the smallest block whose compute hides a transfer, and a step-by-step
// simulation of the schedule src/strategy/ring.cc runs. See docs/plan.md, "The ring schedule".
#include <algorithm>
#include <cmath>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy.h"

namespace ctxpar {
namespace {

// Global position of local token i on rank r (increasing in i for every layout).
struct RankPositions {
  LayoutKind layout;
  int64_t seq;
  int ranks, rank;
  int64_t local() const { return seq / ranks; }
  int64_t operator()(int64_t i) const {
    switch (layout) {
      case LayoutKind::contiguous:
        return rank * local() + i;
      case LayoutKind::striped:
        return rank + static_cast<int64_t>(ranks) * i;
      case LayoutKind::balanced:  // under a causal mask: head-tail pairs, modelled as zigzag
      case LayoutKind::zigzag: {
        const int64_t chunk = seq / (2 * ranks);
        return i < chunk ? rank * chunk + i : (2 * ranks - 1 - rank) * chunk + (i - chunk);
      }
    }
    return 0;
  }
};

// Sum over x in [0, X) of clamp(x, 0, m): the visible keys of query rows whose key counts run
// 0, 1, 2, ... capped at the m keys of the block.
double capped_prefix(double X, double m) {
  if (X <= 0) return 0;
  if (X <= m + 1) return X * (X - 1) / 2;
  return m * (m + 1) / 2 + (X - m - 1) * m;
}

// Causal pairs between query positions [a, a+n) and key positions [b, b+m): query a+i sees
// clamp(a + i - b + 1, 0, m) keys.
double causal_range_pairs(double a, double n, double b, double m) {
  const double x0 = a - b + 1;
  return capped_prefix(x0 + n, m) - capped_prefix(x0, m);
}

// Pairs counted the way the kernel computes them: square tiles of `tile` local tokens, a tile
// skipped only when its smallest key position exceeds its largest query position.
double tiled_pairs(const RankPositions& q, const RankPositions& k, int64_t tile) {
  const int64_t n = q.local(), tiles = (n + tile - 1) / tile;
  double pairs = 0;
  int64_t visible = 0;  // key tiles [0, visible) have k_lo <= q_hi; grows with the query tile
  for (int64_t qt = 0; qt < tiles; ++qt) {
    const int64_t i0 = qt * tile, i1 = std::min(n, i0 + tile);
    const int64_t q_hi = q(i1 - 1);
    while (visible < tiles && k(visible * tile) <= q_hi) ++visible;
    const int64_t cols = std::min(n, visible * tile);
    pairs += static_cast<double>(i1 - i0) * cols;
  }
  return pairs;
}

}  // namespace

double visible_pairs(LayoutKind layout, int64_t seq, int ranks, int q_rank, int k_rank, bool causal,
                     int tile) {
  CTXPAR_CHECK(ranks >= 1 && seq % ranks == 0, "visible_pairs: seq must divide by ranks");
  const double n = static_cast<double>(seq / ranks);
  if (!causal) return n * n;
  const RankPositions q{layout, seq, ranks, q_rank}, k{layout, seq, ranks, k_rank};
  if (tile > 0) return tiled_pairs(q, k, tile);
  switch (layout) {
    case LayoutKind::contiguous:
      return causal_range_pairs(q(0), n, k(0), n);
    case LayoutKind::striped:
      // Query r + P*i sees key s + P*j iff j <= i (s <= r) or j < i (s > r).
      return k_rank <= q_rank ? n * (n + 1) / 2 : n * (n - 1) / 2;
    case LayoutKind::balanced:  // modelled as zigzag (RankPositions)
    case LayoutKind::zigzag: {
      const double c = n / 2;
      const double qa[2] = {static_cast<double>(q(0)), static_cast<double>(q(seq / (2 * ranks)))};
      const double kb[2] = {static_cast<double>(k(0)), static_cast<double>(k(seq / (2 * ranks)))};
      double sum = 0;
      for (double a : qa)
        for (double b : kb) sum += causal_range_pairs(a, c, b, c);
      return sum;
    }
  }
  return 0;
}

// Why three values suffice: each layout places a rank's tokens in chunks of consecutive
// positions (contiguous: chunk r; zigzag: chunks r and 2P-1-r of 2P; striped: position r + P i),
// and visible_pairs only compares key positions with query positions. Two positions in
// different chunks compare as their chunks do. For zigzag, with k != q: chunk k < chunk
// 2P-1-q and chunk 2P-1-k > chunk q always, while k vs q and 2P-1-k vs 2P-1-q follow the sign
// of q - k; contiguous is the one-chunk case. Striped: k + P j <= q + P i iff j <= i (k <= q)
// or j < i (k > q), as |q - k| < P. So every comparison, and the count, depends on the sign
// of q - k alone (tests/plan/balance_test.cc checks this against visible_pairs pair by pair).
RankPairs::RankPairs(LayoutKind layout, int64_t seq, int ranks, bool causal, int tile) {
  CTXPAR_CHECK(ranks >= 1, "RankPairs: ranks must be >= 1, got ", ranks);
  same_ = visible_pairs(layout, seq, ranks, 0, 0, causal, tile);
  if (ranks == 1) return;
  before_ = visible_pairs(layout, seq, ranks, 1, 0, causal, tile);
  after_ = visible_pairs(layout, seq, ranks, 0, 1, causal, tile);
}

namespace {
// Smallest c > 0 with alpha c^2 >= beta c + gamma.
double solve_overlap(double alpha, double beta, double gamma) {
  return (beta + std::sqrt(beta * beta + 4 * alpha * gamma)) / (2 * alpha);
}
}  // namespace

// Per step of the ring, per batch row and head group (D cancels when latency is zero):
//   forward:  compute 4 c^2 Hq D f / F   >=  send K, V: 2 c Hkv D s / B + L
//   backward: compute 2.5x forward       >=  K, V (dtype s) and dK, dV (fp32) + 2 L
// With bf16 (s = 2), Hkv = Hq, f = 1 and L = 0 the forward bound is Ring Attention's c >= F/B.
MinBlock min_block_tokens(double flops_per_second, const LinkSpec& link, int64_t heads,
                          int64_t kv_heads, int64_t head_dim, size_t dtype_bytes, double fraction) {
  CTXPAR_CHECK(flops_per_second > 0, "min_block_tokens: flops must be > 0");
  CTXPAR_CHECK(link.gbytes_per_second > 0, "min_block_tokens: link bandwidth must be > 0");
  CTXPAR_CHECK(heads > 0 && kv_heads > 0 && head_dim > 0 && fraction > 0,
               "min_block_tokens: heads, kv_heads, head_dim and fraction must be > 0");
  const double B = link.gbytes_per_second * 1e9, L = link.latency_us * 1e-6;
  const double alpha = 4.0 * heads * head_dim * fraction / flops_per_second;
  const double kv = 2.0 * kv_heads * head_dim * static_cast<double>(dtype_bytes) / B;
  const double dkv = 2.0 * kv_heads * head_dim * 4.0 / B;
  MinBlock m;
  m.forward = solve_overlap(alpha, kv, L);
  m.backward = solve_overlap(2.5 * alpha, kv + dkv, 2 * L);
  m.tokens = std::max(m.forward, m.backward);
  return m;
}

RingSimulation simulate_ring(const RingProblem& pr) {
  const int P = pr.ranks;
  CTXPAR_CHECK(P >= 1, "simulate_ring: ranks must be >= 1, got ", P);
  CTXPAR_CHECK(pr.seq > 0 && pr.seq % P == 0,
               "simulate_ring: seq must be a positive multiple of ranks");
  CTXPAR_CHECK(pr.links.size() == 1 || static_cast<int>(pr.links.size()) == P,
               "simulate_ring: links must have 1 or ", P, " entries");
  CTXPAR_CHECK(pr.flops_per_second.size() == 1 || static_cast<int>(pr.flops_per_second.size()) == P,
               "simulate_ring: flops_per_second must have 1 or ", P, " entries");
  CTXPAR_CHECK(pr.backward_flops_per_second.size() <= 1 ||
                   static_cast<int>(pr.backward_flops_per_second.size()) == P,
               "simulate_ring: backward_flops_per_second must have 0, 1 or ", P, " entries");
  auto link = [&](int r) -> const LinkSpec& { return pr.links[pr.links.size() == 1 ? 0 : r]; };
  auto pick = [](const std::vector<double>& v, int r) { return v[v.size() == 1 ? 0 : r]; };
  auto rate = [&](int r, bool bwd) {
    return bwd && !pr.backward_flops_per_second.empty() ? pick(pr.backward_flops_per_second, r)
                                                        : pick(pr.flops_per_second, r);
  };
  const int64_t n = pr.seq / P;
  const double per_pair = 4.0 * pr.batch * pr.heads * pr.head_dim;  // forward FLOPs per pair
  // A K/V block travels with its tokens' positions; dK, dV travel as fp32.
  const double kv_bytes = 2.0 * pr.batch * n * pr.kv_heads * pr.head_dim * pr.dtype_bytes + 8.0 * n;
  const double dkv_bytes = 2.0 * pr.batch * n * pr.kv_heads * pr.head_dim * 4.0;
  // pairs[r]: score pairs rank r computes at the current step, where it holds the block of
  // rank (r - s) mod P. Filled a step at a time: memory O(P), not P x P.
  const RankPairs rank_pairs(pr.layout, pr.seq, P, pr.causal, pr.tile);
  std::vector<double> pairs(P);
  auto pairs_of_step = [&](int s) {
    for (int r = 0; r < P; ++r) pairs[r] = rank_pairs(r, ((r - s) % P + P) % P);
  };
  double total_pairs = 0;
  // Per-step traces only for rings small enough to read them (plan_json prints them up to
  // this size); every rank's totals are kept either way. P^2 traces at P = 4096 were 0.8 GB.
  const bool keep_steps = P <= kRingStepsTraced;
  auto record = [&](std::vector<RingStepTrace>& steps, RingRankTrace& t, const RingStepTrace& st) {
    t.compute += st.compute, t.wait += st.wait;
    if (keep_steps) steps.push_back(st);
  };
  auto add_wait = [&](std::vector<RingStepTrace>& steps, RingRankTrace& t, double w) {
    t.wait += w;
    if (keep_steps) steps.back().wait += w;
  };

  RingSimulation sim;
  sim.ranks.assign(P, {});
  std::vector<double> link_free(P, 0.0), now(P, 0.0);
  // A message posted on rank r's outgoing link at time t leaves when the link is idle; the
  // send completes when its last byte has left, and arrives `latency` later (as the threads
  // transport's SimulatedLink). Returns {send complete, delivered}.
  struct Posted {
    double done, arrive;
  };
  auto post = [&](int r, double t, double bytes) {
    const double begin = std::max(link_free[r], t);
    link_free[r] = begin + bytes / (link(r).gbytes_per_second * 1e9);
    sim.ranks[r].bytes_sent += bytes;
    return Posted{link_free[r], link_free[r] + link(r).latency_us * 1e-6};
  };
  auto compute_seconds = [&](int r, double factor, bool bwd) {
    if (pairs[r] == 0) return 0.0;  // fully masked: every tile skipped
    return factor * per_pair * pairs[r] / rate(r, bwd) + pr.step_overhead_seconds;
  };

  // Forward (src/strategy/ring.cc): post step s+1's send and receive, compute step s, then
  // wait for the receive and for our own send to have left.
  // Each step in two phases: every rank posts at its step start (known from the step
  // before), then computes and waits for what its predecessor posted.
  std::vector<Posted> sent(P);
  for (int s = 0; s < P; ++s) {
    pairs_of_step(s);
    for (int r = 0; r < P; ++r) total_pairs += pairs[r];
    std::fill(sent.begin(), sent.end(), Posted{0, 0});
    if (s + 1 < P)
      for (int r = 0; r < P; ++r) sent[r] = post(r, now[r], kv_bytes);
    for (int r = 0; r < P; ++r) {
      RingStepTrace st;
      st.start = now[r];
      st.compute = compute_seconds(r, 1.0, false);
      const double end = st.start + st.compute;
      now[r] = s + 1 < P ? std::max({end, sent[(r + P - 1) % P].arrive, sent[r].done}) : end;
      st.wait = now[r] - end;
      record(sim.ranks[r].forward, sim.ranks[r], st);
    }
  }
  double fwd_end = 0;
  for (int r = 0; r < P; ++r) fwd_end = std::max(fwd_end, now[r]);
  if (pr.barrier_after_forward) {
    for (int r = 0; r < P; ++r) {
      add_wait(sim.ranks[r].forward, sim.ranks[r], fwd_end - now[r]);
      now[r] = fwd_end;
    }
  }
  sim.forward_seconds = fwd_end;

  if (pr.backward) {
    // Backward (src/strategy/ring.cc): K, V go ahead as in forward. Step 0 adds the rank's
    // own block's dK, dV into a buffer that never travels; from step 1 on, the fp32
    // accumulator of the block held is created by its first visitor (step 1) or arrives from
    // rank r-1 after its compute on that block (step > 1), and must be here before our
    // compute adds to it; after the compute (and once our previous accumulator has left) it
    // goes on to r+1. P-1 hops bring every accumulator home.
    std::vector<double> arrive_dkv(P, 0.0), dkv_done(P, 0.0), next_dkv(P);
    const std::vector<int64_t> last_cuts = ring_last_hop_cuts(n), whole = {0, n};
    for (int s = 0; s < P; ++s) {
      pairs_of_step(s);
      std::fill(sent.begin(), sent.end(), Posted{0, 0});
      if (s + 1 < P)
        for (int r = 0; r < P; ++r) sent[r] = post(r, now[r], kv_bytes);
      std::fill(next_dkv.begin(), next_dkv.end(), 0.0);
      for (int r = 0; r < P; ++r) {
        RingStepTrace st;
        st.start = now[r];
        double t = st.start;
        if (s > 1 && pr.accumulator_before_compute) t = std::max(t, arrive_dkv[r]);
        st.compute = compute_seconds(r, 2.5, true);
        double end = t + st.compute;
        double waited = t - st.start;
        if (s > 0) {
          // The accumulator goes on after the compute, once it has arrived (from step 2 on)
          // and our previous one has left; the last step sends it home in pieces of key rows,
          // each right after its share of the compute (Note [Pipelined last hop] in
          // src/strategy/ring.cc; the step's compute spread over the pieces by rows).
          const std::vector<int64_t>& cuts =
              s == P - 1 && !pr.accumulator_before_compute ? last_cuts : whole;
          end = t;
          for (size_t c = 0; c + 1 < cuts.size(); ++c) {
            const double share = double(cuts[c + 1] - cuts[c]) / double(n);
            end += st.compute * share;
            if (c == 0) {
              const bool arrives = s > 1 && !pr.accumulator_before_compute;
              const double after = std::max({end, arrives ? arrive_dkv[r] : end, dkv_done[r]});
              waited += after - end;
              end = after;
            }
            const Posted g = post(r, end, dkv_bytes * share);
            dkv_done[r] = g.done;
            next_dkv[(r + 1) % P] = g.arrive;
          }
        }
        if (s + 1 < P) {
          const double after = std::max({end, sent[(r + P - 1) % P].arrive, sent[r].done});
          waited += after - end;
          end = after;
        }
        st.wait = waited;
        now[r] = end;
        record(sim.ranks[r].backward, sim.ranks[r], st);
      }
      std::swap(arrive_dkv, next_dkv);
    }
    if (P > 1)
      for (int r = 0; r < P; ++r) {
        const double after = std::max({now[r], arrive_dkv[r], dkv_done[r]});
        add_wait(sim.ranks[r].backward, sim.ranks[r], after - now[r]);
        now[r] = after;
      }
  }

  double slowest_compute = 0;
  for (int r = 0; r < P; ++r) {
    RingRankTrace& t = sim.ranks[r];
    t.finish = now[r];
    sim.seconds = std::max(sim.seconds, t.finish);
    slowest_compute = std::max(slowest_compute, t.compute);
  }
  sim.backward_seconds = sim.seconds - sim.forward_seconds;
  sim.compute_seconds = slowest_compute;
  sim.exposed_comm = std::max(0.0, sim.seconds - slowest_compute);
  double fwd_rate = 0, bwd_rate = 0;
  for (int r = 0; r < P; ++r) fwd_rate += rate(r, false) / P, bwd_rate += rate(r, true) / P;
  sim.perfect_seconds =
      per_pair * total_pairs * (1.0 / fwd_rate + (pr.backward ? 2.5 / bwd_rate : 0)) / P;
  sim.efficiency = sim.seconds > 0 ? sim.perfect_seconds / sim.seconds : 1.0;
  return sim;
}

}  // namespace ctxpar
