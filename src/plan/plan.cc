// One plan: memory, FLOPs, communication, overlap and the ring's schedule for a model on a
// cluster, and an estimate of every strategy for --compare. See docs/plan.md.
#include <algorithm>
#include <cmath>

#include "ctxpar/error.h"
#include "ctxpar/plan.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar {
namespace {

int64_t kv_per_device(const PlanInput& in) {
  return std::max<int64_t>(1, in.model.kv_heads / in.tp);
}

// Ranks are placed tp-fastest, then cp, then dp (Megatron's order): cp neighbours are tp
// devices apart, and a hop between two nodes uses the inter-node link.
bool same_node(const PlanInput& in, int cp_a, int cp_b) {
  const int64_t per = in.hardware.devices_per_node;
  return (int64_t{cp_a} * in.tp) / per == (int64_t{cp_b} * in.tp) / per;
}

std::vector<LinkSpec> ring_links(const PlanInput& in, int ranks, int stride) {
  std::vector<LinkSpec> links(ranks);
  for (int r = 0; r < ranks; ++r)
    links[r] = same_node(in, r * stride, ((r + 1) % ranks) * stride) ? in.hardware.intra
                                                                     : in.hardware.inter;
  return links;
}

LinkSpec slowest_link(const PlanInput& in, int ranks, int stride) {
  LinkSpec w = in.hardware.intra;
  for (const auto& l : ring_links(in, ranks, stride))
    if (l.gbytes_per_second < w.gbytes_per_second) w = l;
  return w;
}

RingProblem ring_problem(const PlanInput& in, int ranks, int64_t heads, int64_t kv_heads,
                         int stride) {
  RingProblem p;
  p.ranks = ranks;
  p.batch = in.batch;
  p.seq = in.seq;
  p.heads = heads;
  p.kv_heads = kv_heads;
  p.head_dim = in.model.head_dim;
  p.dtype_bytes = dtype_size(in.dtype);
  p.layout = in.layout;
  p.causal = in.causal;
  p.backward = true;
  p.tile = in.tile;
  p.links = ring_links(in, ranks, stride);
  p.flops_per_second = {in.hardware.effective_flops()};
  p.backward_flops_per_second = {in.hardware.effective_backward_flops()};
  p.barrier_after_forward = ring_forward_ends_with_barrier(ranks, in.hardware.lends_sent_buffers);
  return p;
}

// All-to-all among `ranks` cp-neighbours: bytes to peers on this node go over the intra link,
// the rest over the inter link, the two in parallel.
double alltoall_seconds(const PlanInput& in, int ranks, int stride, double bytes_sent) {
  if (ranks <= 1 || bytes_sent <= 0) return 0;
  int local = 0;
  for (int j = 1; j < ranks; ++j) local += same_node(in, 0, j * stride);
  const double per_peer = bytes_sent / (ranks - 1);
  double t = 0;
  if (local > 0) t = std::max(t, in.hardware.intra.seconds(per_peer * local));
  if (local < ranks - 1) t = std::max(t, in.hardware.inter.seconds(per_peer * (ranks - 1 - local)));
  return t;
}

}  // namespace

// Largest u dividing P with the per-device query heads divisible by u (KV heads replicated if
// fewer), preferring groups that stay inside a node.
int plan_ulysses_degree(const PlanInput& in) {
  if (in.ulysses_degree > 0) return in.ulysses_degree;
  const int64_t hq = in.model.heads / in.tp;
  int best = 1;
  for (int u = 1; u <= in.cp; ++u)
    if (in.cp % u == 0 && hq % u == 0 && int64_t{u} * in.tp <= in.hardware.devices_per_node)
      best = u;
  return best;
}

namespace {

StrategyEstimate estimate(const PlanInput& in, StrategyKind kind, const RingSimulation* ring) {
  StrategyEstimate e;
  e.strategy = kind;
  const int P = in.cp;
  const double layers = static_cast<double>(layers_per_stage(in));
  const int64_t hq = in.model.heads / in.tp, hkv = kv_per_device(in);
  const double F = in.hardware.effective_flops();
  const double T = static_cast<double>(in.seq);
  const double pairs = in.causal ? T * (T + 1) / 2 : T * T;
  const double fwd_flops = 4.0 * in.batch * hq * in.model.head_dim * pairs;
  const double Fb = in.hardware.effective_backward_flops();
  const double perfect = (fwd_flops / F + 2.5 * fwd_flops / Fb) / P;  // one layer, split evenly
  const size_t s = dtype_size(in.dtype);
  PlanInput sized = in;
  sized.strategy = kind;
  double seconds = 0;
  int u = plan_ulysses_degree(in);
  switch (kind) {
    case StrategyKind::ring:
      seconds = ring->seconds;
      break;
    case StrategyKind::allgather: {
      // K, V of every rank gathered in g head groups: the first group's gather is exposed,
      // the rest hides behind the previous group's compute; dK, dV reduce-scatter at the end.
      const int g = static_cast<int>(plan_allgather_groups(in));
      const double kv = in.batch * (T / P) * hkv * in.model.head_dim * static_cast<double>(s);
      const LinkSpec slow = slowest_link(in, P, 1);
      const double gather = P > 1 ? (P - 1) * slow.seconds(2 * kv) : 0;
      const double scatter = P > 1 ? (P - 1) * slow.seconds(2 * kv * 4.0 / s) : 0;
      double worst = 0;
      const RankPairs pairs_of(in.layout, in.seq, P, in.causal, in.tile);
      for (int r = 0; r < P; ++r) {
        double rank_pairs = 0;
        for (int k = 0; k < P; ++k) rank_pairs += pairs_of(r, k);
        const double c = 4.0 * in.batch * hq * in.model.head_dim * rank_pairs / F;
        auto pass = [&](double compute) {
          return gather / g + std::max(compute, gather * (g - 1) / g);
        };
        worst = std::max(worst, pass(c) + pass(2.5 * c * F / Fb) + scatter);
      }
      seconds = worst;
      break;
    }
    case StrategyKind::ulysses:
      u = P;
      [[fallthrough]];
    case StrategyKind::hybrid: {
      if (hq % u != 0 || P % u != 0) {
        e.valid = false;
        e.why_invalid = "query heads per device (" + std::to_string(hq) +
                        ") must be divisible by the Ulysses degree " + std::to_string(u);
        return e;
      }
      const CommVolume a = attention_comm_bytes(StrategyKind::ulysses, u, 0, in.batch,
                                                in.seq / (P / u), hq, hkv, in.model.head_dim, s);
      const double a2a = alltoall_seconds(in, u, 1, a.forward_bytes + a.backward_bytes);
      if (kind == StrategyKind::ulysses) {
        seconds = a2a + perfect;  // all heads balanced, nothing overlapped
      } else {
        RingProblem rp = ring_problem(in, P / u, hq / u, std::max<int64_t>(1, hkv / u), u);
        seconds = a2a + simulate_ring(rp).seconds;
      }
      break;
    }
  }
  const CommVolume c =
      attention_comm_bytes(kind, P, u, in.batch, in.seq, hq, hkv, in.model.head_dim, s);
  e.bytes_per_step = layers * (c.forward_bytes + c.backward_bytes);
  e.attention_seconds = layers * seconds;
  e.exposed_comm_seconds = std::max(0.0, layers * (seconds - perfect));
  e.efficiency = seconds > 0 ? perfect / seconds : 1.0;
  const MemoryBreakdown mem = plan_memory(sized);
  e.attention_buffer_bytes = mem.attention_buffers;
  e.fits = mem.fits;
  return e;
}

int smallest_cp_that_fits(PlanInput in) {
  for (int cp = 1; cp <= (1 << 16); cp *= 2) {
    in.cp = cp;  // seq padded to this cp's granule, as the runtime would (plan_padded_seq)
    if (plan_memory(in).fits) return cp;
  }
  return 0;
}

}  // namespace

int64_t plan_allgather_groups(const PlanInput& in) {
  return allgather_head_groups(kv_per_device(in));
}

Plan make_plan(const PlanInput& given, bool compare) {
  validate(given);
  Plan p;
  p.input = given;
  p.padded_seq = plan_padded_seq(given);
  // The attention models run on the padded sequence the runtime cuts (padding tokens are
  // modelled as real ones: at most granule - 1 of them).
  PlanInput in = given;
  in.seq = p.padded_seq;
  p.memory = plan_memory(given);
  p.flops = plan_flops(given);
  const int64_t hq = in.model.heads / in.tp, hkv = kv_per_device(in);
  const size_t s = dtype_size(in.dtype);
  const double layers = static_cast<double>(layers_per_stage(in));
  for (StrategyKind k :
       {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses, StrategyKind::hybrid}) {
    const int u = k == StrategyKind::hybrid ? plan_ulysses_degree(in) : 0;
    if (k == StrategyKind::ulysses && hq % in.cp != 0) continue;
    if (k == StrategyKind::hybrid && (in.cp % u != 0 || hq % u != 0)) continue;
    CommVolume c =
        attention_comm_bytes(k, in.cp, u, in.batch, in.seq, hq, hkv, in.model.head_dim, s);
    c.step_bytes = layers * (c.forward_bytes + c.backward_bytes);
    p.comm.push_back(c);
  }
  // The ring's slowest hop decides whether its transfers hide.
  const LinkSpec slow = slowest_link(in, in.cp, 1);
  p.min_block = min_block_tokens(in.hardware.effective_flops(), slow, hq, hkv, in.model.head_dim, s,
                                 in.causal ? 0.5 : 1.0);
  p.block_tokens = in.seq / in.cp;
  RingProblem rp = ring_problem(in, in.cp, hq, hkv, 1);
  p.ring = simulate_ring(rp);
  rp.accumulator_before_compute = true;
  p.ring_seconds_accumulator_before = simulate_ring(rp).seconds;
  p.dense_seconds = p.flops.dense_step / (static_cast<double>(in.cp) * in.tp * in.pp) /
                    in.hardware.effective_flops();
  std::vector<StrategyKind> kinds = {in.strategy};
  if (compare)
    kinds = {StrategyKind::ring, StrategyKind::allgather, StrategyKind::ulysses,
             StrategyKind::hybrid};
  for (StrategyKind k : kinds) p.compare.push_back(estimate(in, k, &p.ring));
  std::stable_sort(p.compare.begin(), p.compare.end(), [](const auto& a, const auto& b) {
    if (a.valid != b.valid) return a.valid;
    return a.attention_seconds < b.attention_seconds;
  });
  for (const auto& e : p.compare)
    if (e.strategy == in.strategy) {
      CTXPAR_CHECK(e.valid, "plan: strategy ", strategy_name(e.strategy), ": ", e.why_invalid,
                   " (try the ring strategy, or compare every strategy)");
      p.step_seconds = p.dense_seconds + e.attention_seconds;
    }
  p.cp_to_fit = smallest_cp_that_fits(given);
  PlanInput rc = given;
  rc.recompute = Recompute::full;
  p.cp_to_fit_recompute = smallest_cp_that_fits(rc);
  return p;
}

}  // namespace ctxpar
