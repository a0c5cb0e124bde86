// The strategies' memory model (ctxpar/strategy_memory.h): the DeviceBuffers and
// DeviceForwardStates ring.cc, allgather.cc, ulysses.cc and hybrid.cc hold, walked in the
// order the code allocates and releases them. docs/plan.md, "Attention buffers". Ulysses' head
// rules live here once: ulysses.cc deals its heads out by them.
#include <algorithm>
#include <numeric>
#include <vector>

#include "ctxpar/strategy_memory.h"

namespace ctxpar {

int64_t ulysses_kv_slots(int64_t heads, int64_t kv_heads, int ranks) {
  const int64_t local = std::max<int64_t>(1, heads / ranks);
  const int64_t group = heads / std::max<int64_t>(1, kv_heads);
  return kv_heads % ranks == 0 ? kv_heads / ranks : group % local == 0 ? 1 : local;
}

int ulysses_pipeline_groups(int64_t heads, int64_t kv_heads, int ranks, int64_t batch, int threads,
                            AttentionPass pass, int limit) {
  const int64_t hq = heads / ranks, hk = ulysses_kv_slots(heads, kv_heads, ranks);
  const int64_t common = std::gcd(hq, hk);
  // Backward keeps batch * hk / G KV heads per kernel call >= its threads: below that the fast
  // kernel splits a head's key tiles over threads (Note [Backward tasks]) and would sum
  // dK/dV/dQ in another order than the unpipelined call; with it, every group's results are
  // the same bits as G = 1's.
  for (int n = int(std::min<int64_t>(limit, common)); n > 1; --n)
    if (common % n == 0 && (pass == AttentionPass::forward || batch * hk / n >= threads)) return n;
  return 1;
}

namespace {

// One rank's share of a call, in bytes. B, D: batch and head dim; es, eo: the input and
// output element sizes.
struct Sizes {
  double B, D, es, eo;
  bool documents;
  // A K/V block (KvPacking): k, v [B, t, hk, D] and the t tokens' positions (document ids).
  double pack(double t, double hk) const {
    return 2 * B * t * hk * D * es + t * (8 + (documents ? 4 : 0));
  }
  // An fp32 [dK | dV] accumulator of t tokens.
  double grad(double t, double hk) const { return 8 * B * t * hk * D; }
  // DeviceForwardState: fp32 accumulator [B, t, hq, D], m and l [B, hq, t].
  double state(double t, double hq) const { return 4 * B * t * hq * D + 8 * B * hq * t; }
  // BackwardRows: fp32 dQ [B, t, hq, D] and delta [B, hq, t].
  double rows(double t, double hq) const { return 4 * B * t * hq * D + 4 * B * hq * t; }
};

// ring_forward over R ranks: the state, the block sent on and the one arriving.
double ring_forward(const Sizes& z, int R, double t, double hq, double hk) {
  return z.state(t, hq) + (R > 1 ? 2 * z.pack(t, hk) : 0);
}

// ring_backward over R ranks (the caller's dQ and delta not included): `own`, the
// accumulator `acc`, the local `part`, the accumulator arriving, and on the last step the
// pieces of the own block's accumulator coming home (Note [Pipelined last hop]: one more
// accumulator in all, and each piece sent from a copy of its rows).
double ring_backward(const Sizes& z, int R, int64_t t, double hk) {
  const double pk = z.pack(double(t), hk), g = z.grad(double(t), hk);
  if (R == 1) return g;
  if (R == 2) {  // one step after the own block: own, acc and the pieces coming home
    const std::vector<int64_t> cuts = ring_last_hop_cuts(t);
    const double piece = t > 0 ? g * double(cuts[1] - cuts[0]) / double(t) : 0;
    return std::max(2 * pk + g, pk + 3 * g + piece);
  }
  // From step 2 on own, acc (in flight), the arriving accumulator and part: four, with two
  // blocks (P = 3: step 1's three); the last step adds the pieces coming home (five).
  return std::max(2 * pk + (R == 3 ? 3 : 4) * g, pk + 5 * g);
}

// The ring's needed exchange (ring_needed.cc) when every tile is needed, its most: the rows
// received and computed on, those packed for the next peer and those arriving (three blocks
// from P = 3 on); backward adds `own`, the local part, the gradients coming home for this step
// and those of the previous step not yet added. Fewer tiles needed hold less.
double ring_needed(const Sizes& z, int R, double t, double hq, double hk, AttentionPass pass) {
  const double pk = z.pack(t, hk), g = z.grad(t, hk);
  if (pass == AttentionPass::forward) return z.state(t, hq) + (R > 2 ? 3 : R == 2 ? 2 : 0) * pk;
  const double bwd = R == 1   ? g
                     : R == 2 ? std::max(2 * pk + g, pk + 3 * g)
                     : R == 3 ? std::max(3 * pk + 3 * g, pk + 4 * g)
                              : 3 * pk + 4 * g;
  return z.rows(t, hq) + bwd;
}

// allgather: every peer's block of one head group and this rank's packed copies for them,
// two groups at once (the next one's exchange is posted before this one computes); backward
// adds each group's reduce-scatter (the P parts this rank sums, the P - 1 it sent), kept one
// group longer, and the sum of a finished group.
double allgather(const StrategyOptions& o, const Sizes& z, const AttentionDims& d, int P,
                 AttentionPass pass) {
  const double tl = double(d.seq / P);
  const int64_t G = allgather_head_groups(d.kv_heads, o.head_groups);
  const double hk = double(d.kv_heads / G), hq = hk * double(d.heads / d.kv_heads);
  const double gathered = 2.0 * (P - 1) * z.pack(tl, hk);
  if (pass == AttentionPass::forward) return z.state(tl, hq) + (G > 1 ? 2 : 1) * gathered;
  const double reduce = (2.0 * P - 1) * z.grad(tl, hk), sum = z.grad(tl, hk);
  double peak = sum + reduce;                          // the last group's reduce, summed
  for (int64_t g : {int64_t{0}, int64_t{1}, G - 1}) {  // every middle group is group 1
    if (g >= G) continue;
    const double next = g + 1 < G ? gathered : 0;
    peak = std::max(peak, gathered + next + (g > 0 ? 2 : 1) * reduce);
    if (g > 0) peak = std::max(peak, next + 2 * reduce + sum);  // group g - 1 summed
  }
  return z.rows(tl, double(d.heads)) + peak;
}

// Ulysses over u ranks around an inner computation (ulysses: the kernel; hybrid: a ring over
// P / u): the group's positions, sort index (and document ids), and per head group the
// all-to-all in (send and receive), the whole-sequence tensors, the all-to-all back.
double ulysses(const StrategyOptions& o, const Sizes& z, const AttentionDims& d, int P, int u,
               AttentionPass pass) {
  const bool bwd = pass == AttentionPass::backward;
  const int64_t tl = d.seq / P, t = tl * u, R = P / u;
  const int limit = o.ulysses_groups > 0             ? o.ulysses_groups
                    : o.kind == StrategyKind::hybrid ? 1
                                                     : kUlyssesDefaultGroups;
  const int G =
      ulysses_pipeline_groups(d.heads, d.kv_heads, u, d.batch, o.kernel.threads, pass, limit);
  const double gq = double(d.heads / u / G);
  const double gk = double(ulysses_kv_slots(d.heads, d.kv_heads, u) / G);
  const double B = z.B, D = z.D, es = z.es, eo = z.eo, tld = double(tl), td = double(t);
  const double tokens = td * (16 + (z.documents ? 4 : 0));
  const bool ring = o.kind == StrategyKind::hybrid;
  double peak = 0;
  if (!bwd) {
    const double in = 2.0 * u * B * tld * D * (gq + 2 * gk) * es;
    const double back = 2.0 * u * B * tld * gq * (D * eo + 4);
    const double whole = B * td * D * (gq + 2 * gk) * es + B * td * gq * (D * eo + 4);
    // ulysses: the state where the device runs the block and its finalize (cuda); the host
    // devices run the whole forward without one (Device::forward_whole). Either way the peak
    // is the same where the group's incoming Q, K, V (`in`) outweigh the state (bf16: D gk >=
    // gq; fp32 always), which the model test's shapes check on the cpu device.
    const double inner = ring ? ring_forward(z, int(R), td, gq, gk) : z.state(td, gq);
    for (int g = 0; g < G; ++g) {
      const double next = g + 1 < G ? in : 0, returning = g > 0 ? back : 0;
      peak = std::max({peak, in + next + whole + returning, next + whole + inner + returning,
                       next + whole + back + returning});
    }
    return tokens + std::max(peak, back);
  }
  const double in = 2.0 * u * B * tld * (D * (gq * es + 2 * gk * es + gq * eo) + 8 * gq);
  const double back = u * B * tld * D * (4 * gq + 8 * gk);  // one side: the send goes at once
  const double whole =
      B * td * (D * (gq * es + 2 * gk * es + gq * eo) + 8 * gq + D * (4 * gq + 8 * gk));
  const double inner = ring ? ring_backward(z, int(R), t, gk) : 0;
  for (int g = 0; g < G; ++g) {
    const double next = g + 1 < G ? in : 0, returned = g * back;
    peak = std::max({peak, in + next + whole + returned, next + whole + inner + returned,
                     next + whole + 2 * back + returned});
  }
  const double dkv32 = 8 * B * tld * double(d.kv_heads) * D;
  const double delta = 4 * B * double(d.heads) * tld;
  return delta + tokens + std::max(peak, G * back + dkv32);
}

}  // namespace

double attention_buffer_bytes(const StrategyOptions& options, const AttentionDims& dims, int ranks,
                              AttentionPass pass) {
  const Sizes z{double(dims.batch), double(dims.head_dim), double(dtype_size(dims.dtype)),
                double(dtype_size(dims.out_dtype)), options.mask.documents};
  if (dims.batch <= 0 || dims.seq <= 0 || dims.heads <= 0 || dims.kv_heads <= 0 ||
      dims.head_dim <= 0)
    return 0;
  const int P = std::max(1, ranks);
  const int64_t tl = dims.seq / P;
  switch (options.kind) {
    case StrategyKind::ring:
      if (exchange_of(options) == Exchange::needed)
        return ring_needed(z, P, double(tl), double(dims.heads), double(dims.kv_heads), pass);
      return pass == AttentionPass::forward
                 ? ring_forward(z, P, double(tl), double(dims.heads), double(dims.kv_heads))
                 : z.rows(double(tl), double(dims.heads)) +
                       ring_backward(z, P, tl, double(dims.kv_heads));
    case StrategyKind::allgather:
      return allgather(options, z, dims, P, pass);
    case StrategyKind::ulysses:
      return ulysses(options, z, dims, P, P, pass);
    case StrategyKind::hybrid:
      return ulysses(options, z, dims, P, options.ulysses_degree > 0 ? options.ulysses_degree : P,
                     pass);
  }
  return 0;
}

}  // namespace ctxpar
