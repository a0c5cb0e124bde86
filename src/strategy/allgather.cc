// All-gather attention (Llama 3 style): every rank gathers the whole sequence's K/V, one head
// group at a time, and attends its local queries to it; backward reduce-scatters dK/dV.
// See docs/allgather.md.
//
// The gather is posted as point-to-point messages (my chunk to every peer, every peer's chunk
// from it), not as the blocking collective, so that group g+1's exchange is in flight while
// group g computes (a device enqueues them; under MPI the transport's progress calls move
// them while the rank computes: by default the CPU kernel makes them between tiles, or a
// progress thread does; docs/comm.md, "Progress"). Likewise the reduce-scatter of group g's dK/dV
// is posted right after its compute and summed, in rank order, one group later.
//
// Under Exchange::needed (docs/allgather.md, "Gathering only what is needed") the same steps
// move only the 64-row K/V tiles some query of the receiver can see (strategy/needed.h's plan,
// shared with the ring): rank j's chunk is the rows of j this rank needs (none: nothing moves,
// nothing is computed), and in backward the dK/dV of those rows go back to j, which adds them
// to its own run by run, still in rank order. Tiles carry their token ids, so the kernel masks
// by true positions and documents.
#include <optional>

#include "strategy/needed.h"

namespace ctxpar::strategy {
namespace {

constexpr int kReduceTag = 8192;  // reduce-scatter messages: kReduceTag + group; gather: group

// One head group's gathered K/V: chunks[j] is rank j's (empty for this rank: read in place),
// complete for the compute stream after `arrived`; `sent` are this rank's packed copies.
struct Gathered {
  std::vector<DeviceBuffer> chunks, sent;
  Event arrived;
};

// Reduce-scatter of one head group's dK/dV: parts[j] is rank j's share of this rank's dK/dV
// (this rank's own computed here, the others received), complete after `arrived`; `sent` are
// the shares this rank computed for the others.
struct Reduce {
  std::vector<DeviceBuffer> parts, sent;
  Event arrived;
};

class AllGatherStrategy final : public Strategy {
 public:
  AllGatherStrategy(Communicator& comm, const StrategyOptions& options,
                    std::unique_ptr<Device> device)
      : Strategy(comm, options, std::move(device)) {}

 protected:
  std::string check_heads(int64_t hq, int64_t hkv) const override {
    const std::string e = allgather_head_groups_rule(hkv, options_.head_groups);
    return e.empty() ? e : "allgather: " + e;
  }

  void run_forward(const ForwardArgs& a, Call& call) override {
    const TensorView &q = a.q, &k = a.k, &v = a.v, &out = a.out, &lse = a.lse;
    const Tokens& tokens = a.tokens;
    const Dims& dims = call.dims;
    Device& dev = *device_;
    const int64_t groups = groups_of(dims), hg = dims.hkv / groups, qg = hg * (dims.hq / dims.hkv);
    const KvPacking pack{dims.batch, dims.tokens, hg, dims.d, dims.dtype, options_.mask.documents};
    const std::optional<NeededPlan> plan = plan_of(call, tokens, dims.tokens);
    const NeededPlan* needed = plan ? &*plan : nullptr;
    std::vector<Gathered> gathered(groups);
    post_gather(pack, k, v, tokens, 0, gathered[0], needed);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) post_gather(pack, k, v, tokens, g + 1, gathered[g + 1], needed);
      dev.wait(kComputeStream, gathered[g].arrived);
      const TensorView qv = q.slice(2, g * qg, (g + 1) * qg);
      DeviceForwardState state(dev, dims.batch, dims.tokens, qg, dims.d);
      for (int j = 0; j < comm_.size(); ++j) {
        const std::optional<KvBlock> kv = chunk(pack, k, v, tokens, g, gathered[g], j, needed);
        if (!kv) continue;  // none of rank j's rows is visible to this rank's queries
        dev.forward_block(kComputeStream, qv, tokens, kv->k, kv->v, kv->tokens, call.mask,
                          state.get(), call.kernel);
      }
      dev.forward_finalize(kComputeStream, state.get(), out.slice(2, g * qg, (g + 1) * qg),
                           lse.slice(1, g * qg, (g + 1) * qg), call.kernel);
      gathered[g] = Gathered();
    }
  }

  void run_backward(const BackwardArgs& a, Call& call) override {
    const TensorView &q = a.q, &k = a.k, &v = a.v, &dout = a.dout, &lse = a.lse;
    const TensorView &dq = a.dq, &dk = a.dk, &dv = a.dv;
    const Tokens& tokens = a.tokens;
    const Dims& dims = call.dims;
    Device& dev = *device_;
    const int p = comm_.size(), r = comm_.rank();
    const int64_t groups = groups_of(dims), hg = dims.hkv / groups, qg = hg * (dims.hq / dims.hkv);
    const KvPacking pack{dims.batch, dims.tokens, hg, dims.d, dims.dtype, options_.mask.documents};
    const KvPacking grad{dims.batch, dims.tokens, hg, dims.d, DType::f32, false};
    const size_t grad_bytes = 2 * grad.kv_bytes();

    const BackwardRows rows(call, a);
    const TensorView &delta_v = rows.delta, &dq32_v = rows.dq32;
    const std::optional<NeededPlan> plan = plan_of(call, tokens, dims.tokens);
    const NeededPlan* needed = plan ? &*plan : nullptr;
    // Rows of this rank's dK/dV that rank j computed (needed: those j received), and of rank
    // j's that this rank computes.
    auto rows_to = [&](int j) { return needed && j != r ? needed->to_rows(j) : dims.tokens; };
    auto rows_from = [&](int j) { return needed && j != r ? needed->from_rows(j) : dims.tokens; };
    std::vector<Reduce> reduces(groups);
    auto finish_reduce = [&](int64_t g) {
      Reduce& red = reduces[g];
      dev.wait(kComputeStream, red.arrived);
      DeviceBuffer sum = dev.alloc(grad_bytes);
      dev.fill_zero(kComputeStream, flat_f32(sum));
      // Rank order: the same sum on every run (a rank that needed none of this rank's rows
      // sent nothing to add).
      for (int j = 0; j < p; ++j) {
        if (red.parts[j].empty()) continue;
        if (needed && j != r)
          add_runs(dev, rows_of(grad, rows_to(j)), red.parts[j], grad, sum, needed->to(j));
        else
          dev.add(kComputeStream, flat_f32(red.parts[j]), flat_f32(sum));
      }
      dev.copy(kComputeStream, grad.k(sum), dk.slice(2, g * hg, (g + 1) * hg));
      dev.copy(kComputeStream, grad.v(sum), dv.slice(2, g * hg, (g + 1) * hg));
      reduces[g] = Reduce();
    };

    std::vector<Gathered> gathered(groups);
    post_gather(pack, k, v, tokens, 0, gathered[0], needed);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) post_gather(pack, k, v, tokens, g + 1, gathered[g + 1], needed);
      dev.wait(kComputeStream, gathered[g].arrived);
      const TensorView qv = q.slice(2, g * qg, (g + 1) * qg);
      const TensorView dov = dout.slice(2, g * qg, (g + 1) * qg);
      const TensorView lv = lse.slice(1, g * qg, (g + 1) * qg);
      const TensorView dlv = delta_v.slice(1, g * qg, (g + 1) * qg);
      const TensorView dqv = dq32_v.slice(2, g * qg, (g + 1) * qg);
      Reduce& red = reduces[g];
      red.parts.resize(p);
      for (int j = 0; j < p; ++j)
        if (j != r && rows_to(j) > 0)
          red.parts[j] = dev.recv(kCommStream, comm_, 2 * rows_of(grad, rows_to(j)).kv_bytes(), j,
                                  kReduceTag + int(g));
      for (int j = 0; j < p; ++j) {
        const bool own = j == r;
        const std::optional<KvBlock> kv = chunk(pack, k, v, tokens, g, gathered[g], j, needed);
        if (!kv) continue;  // none of rank j's rows is visible: no share of its dK/dV
        const KvPacking share = rows_of(grad, rows_from(j));
        DeviceBuffer part = dev.alloc(2 * share.kv_bytes());  // this rank's share of j's dK/dV
        dev.fill_zero(kComputeStream, flat_f32(part));
        dev.backward_block(kComputeStream, qv, tokens, kv->k, kv->v, kv->tokens, call.mask, dov, lv,
                           dlv, dqv, share.k(part), share.v(part), call.kernel);
        if (own) {
          red.parts[r] = std::move(part);
        } else {
          dev.wait(kCommStream, dev.record(kComputeStream));
          dev.send(kCommStream, comm_, part, j, kReduceTag + int(g));
          red.sent.push_back(std::move(part));
        }
      }
      red.arrived = dev.record(kCommStream);
      gathered[g] = Gathered();
      if (g > 0) finish_reduce(g - 1);  // its messages travelled during this group's compute
    }
    finish_reduce(groups - 1);
    dev.copy(kComputeStream, dq32_v, dq);
  }

 private:
  int64_t groups_of(const Dims& dims) const {
    return allgather_head_groups(dims.hkv, options_.head_groups);
  }
  // The needed exchange's plan (one all-gather of tile summaries), none for the whole gather.
  std::optional<NeededPlan> plan_of(Call& call, const Tokens& tokens, int64_t rows) {
    if (options_.exchange != Exchange::needed) return std::nullopt;  // resolved by create()
    return std::make_optional<NeededPlan>(comm_, call, tokens, rows);
  }

  // Head group g of rank j's K/V block: this rank's own read in place, the others' gathered
  // (needed: only the rows of j this rank needs; none when it needs none of them).
  std::optional<KvBlock> chunk(const KvPacking& pack, const TensorView& k, const TensorView& v,
                               const Tokens& tokens, int64_t g, const Gathered& gathered, int j,
                               const NeededPlan* needed) const {
    if (j == comm_.rank()) {
      const int64_t h0 = g * pack.heads, h1 = h0 + pack.heads;
      return KvBlock{k.slice(2, h0, h1), v.slice(2, h0, h1), tokens};
    }
    if (!needed) return pack.block(gathered.chunks[j]);
    if (needed->from_rows(j) == 0) return std::nullopt;
    return rows_of(pack, needed->from_rows(j)).block(gathered.chunks[j]);
  }

  // `pack`'s layout (K/V or fp32 gradients) for n rows.
  static KvPacking rows_of(const KvPacking& pack, int64_t n) {
    return {pack.batch, n, pack.heads, pack.d, pack.dtype, pack.documents};
  }

  // Posts head group g's exchange: every peer's chunk from it, and a packed copy of mine to
  // every peer (one copy each, so that each send may lend its memory). Needed: only the rows
  // each peer needs go, only those this rank needs come, and a pair with none moves nothing.
  void post_gather(const KvPacking& pack, const TensorView& k, const TensorView& v,
                   const Tokens& tokens, int64_t g, Gathered& out, const NeededPlan* needed) {
    Device& dev = *device_;
    const int p = comm_.size(), r = comm_.rank();
    out.chunks.resize(p);
    const int64_t h0 = g * pack.heads, h1 = h0 + pack.heads;
    const KvBlock mine{k.slice(2, h0, h1), v.slice(2, h0, h1), tokens};
    for (int i = 1; i < p; ++i) {
      const int peer = (r + i) % p;
      if (!needed)
        out.sent.push_back(pack.pack(dev, kComputeStream, mine));
      else if (needed->to_rows(peer) > 0)
        out.sent.push_back(
            pack_rows(dev, mine, needed->to(peer), needed->to_rows(peer), pack.documents));
      else
        out.sent.emplace_back();
    }
    dev.wait(kCommStream, dev.record(kComputeStream));
    for (int j = 0; j < p; ++j) {
      const int64_t in = needed ? needed->from_rows(j) : pack.tokens;
      if (j != r && in > 0)
        out.chunks[j] = dev.recv(kCommStream, comm_, rows_of(pack, in).bytes(), j, int(g));
    }
    for (int i = 1; i < p; ++i)  // r+1 first, so that no rank is everyone's first target
      if (!out.sent[i - 1].empty())
        dev.send(kCommStream, comm_, out.sent[i - 1], (r + i) % p, int(g));
    out.arrived = dev.record(kCommStream);
  }
};

}  // namespace

std::unique_ptr<Strategy> make_allgather(Communicator& comm, const StrategyOptions& options,
                                         std::unique_ptr<Device> device) {
  return std::make_unique<AllGatherStrategy>(comm, options, std::move(device));
}

}  // namespace ctxpar::strategy
