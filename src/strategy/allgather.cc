// All-gather attention (Llama 3 style): every rank gathers the whole sequence's K/V, one head
// group at a time, and attends its local queries to it; backward reduce-scatters dK/dV.
// See docs/allgather.md.
//
// The gather is posted as point-to-point messages (my chunk to every peer, every peer's chunk
// from it), not as the blocking collective, so that group g+1's exchange is in flight while
// group g computes; the MPI transport is FUNNELED (only the calling thread may communicate),
// which rules out a helper thread running the collective. Likewise the reduce-scatter of group
// g's dK/dV is posted right after its compute and summed, in rank order, one group later.
#include <cstring>

#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

constexpr int kReduceTag = 8192;  // reduce-scatter messages: kReduceTag + group; gather: group

// Largest divisor of hkv that is <= 4: the first group's gather is exposed, the rest overlap.
int64_t auto_groups(int64_t hkv) {
  for (int64_t g = 4; g > 1; --g)
    if (hkv % g == 0) return g;
  return 1;
}

// One head group's gathered K/V: chunk[j] is rank j's (empty for this rank: read in place).
struct Gathered {
  std::vector<Request> sends, recvs;
  std::vector<Buffer> chunks;
};

class AllGatherStrategy final : public Strategy {
 public:
  AllGatherStrategy(Communicator& comm, const StrategyOptions& options) : Strategy(comm, options) {}

  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Tokens& tokens, const TensorView& out, const TensorView& lse) override {
    Dims dims;
    std::string e = check_forward(q, k, v, tokens, out, lse, options_.mask, dims);
    if (e.empty()) e = check_groups(dims);
    CallScope call(comm_, stats_, options_, "allgather forward", e, dims, {&comm_});
    Run& run = call.run;
    MemoryTracker& memory = call.memory;
    const int64_t groups = groups_of(dims), hg = dims.hkv / groups, qg = hg * (dims.hq / dims.hkv);
    const KvPacking pack{dims.batch, dims.tokens, hg, dims.d, dims.dtype, options_.mask.documents};
    std::vector<Gathered> gathered(groups);
    post_gather(run, pack, k, v, tokens, 0, gathered[0]);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) post_gather(run, pack, k, v, tokens, g + 1, gathered[g + 1]);
      finish_gather(run, pack, gathered[g]);
      const TensorView qv = q.slice(2, g * qg, (g + 1) * qg);
      ForwardState state(dims.batch, dims.tokens, qg, dims.d);
      memory.hold(state.bytes());
      for (int j = 0; j < comm_.size(); ++j) {
        const bool own = j == comm_.rank();
        const Buffer& c = gathered[g].chunks[j];
        run.busy([&] {
          return attention_forward_block(
              qv, tokens, own ? k.slice(2, g * hg, (g + 1) * hg) : pack.k(c),
              own ? v.slice(2, g * hg, (g + 1) * hg) : pack.v(c), own ? tokens : pack.tokens_of(c),
              run.mask, state, run.kernel);
        });
      }
      run.busy([&] {
        attention_forward_finalize(state, out.slice(2, g * qg, (g + 1) * qg),
                                   lse.slice(1, g * qg, (g + 1) * qg), run.kernel);
        return KernelStats{};
      });
      memory.release(state.bytes() + 2 * size_t(comm_.size() - 1) * pack.bytes());
      gathered[g] = Gathered();
    }
    call.finish();
  }

  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const Tokens& tokens, const TensorView& out, const TensorView& lse,
                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                const TensorView& dv) override {
    Dims dims;
    std::string e =
        check_backward(q, k, v, tokens, out, lse, dout, dq, dk, dv, options_.mask, dims);
    if (e.empty()) e = check_groups(dims);
    CallScope call(comm_, stats_, options_, "allgather backward", e, dims, {&comm_});
    Run& run = call.run;
    MemoryTracker& memory = call.memory;
    const int p = comm_.size(), r = comm_.rank();
    const int64_t groups = groups_of(dims), hg = dims.hkv / groups, qg = hg * (dims.hq / dims.hkv);
    const KvPacking pack{dims.batch, dims.tokens, hg, dims.d, dims.dtype, options_.mask.documents};
    const KvPacking grad{dims.batch, dims.tokens, hg, dims.d, DType::f32, false};
    const size_t grad_bytes = 2 * grad.kv_bytes();

    Tensor delta(DType::f32, {dims.batch, dims.hq, dims.tokens});
    Tensor dq32(DType::f32, q.shape());
    memory.hold(delta.bytes() + dq32.bytes());
    run.busy([&] {
      attention_backward_delta(out, dout, delta, run.kernel);
      return KernelStats{};
    });
    // Reduce-scatter of one group: my own contribution, and the peers' on their way to me.
    struct Reduce {
      Buffer own;
      std::vector<Request> sends, recvs;
    };
    std::vector<Reduce> reduces(groups);
    auto finish_reduce = [&](int64_t g) {
      Reduce& red = reduces[g];
      std::vector<Buffer> parts(p);
      run.waiting([&] {
        for (int j = 0; j < p; ++j)
          if (j != r) parts[j] = red.recvs[j].take();
        for (Request& s : red.sends) s.wait();
      });
      parts[r] = std::move(red.own);
      Tensor sum_k(DType::f32, {dims.batch, dims.tokens, hg, dims.d});
      Tensor sum_v(DType::f32, {dims.batch, dims.tokens, hg, dims.d});
      for (int j = 0; j < p; ++j) {  // rank order: the same sum on every run
        const float* pk = grad.k(parts[j]).ptr<const float>();
        const float* pv = grad.v(parts[j]).ptr<const float>();
        for (int64_t i = 0; i < sum_k.numel(); ++i) {
          sum_k.ptr<float>()[i] += pk[i];
          sum_v.ptr<float>()[i] += pv[i];
        }
      }
      copy_into(sum_k, dk.slice(2, g * hg, (g + 1) * hg));
      copy_into(sum_v, dv.slice(2, g * hg, (g + 1) * hg));
      memory.release(size_t(2 * p - 1) * grad_bytes);
      reduces[g] = Reduce();
    };

    std::vector<Gathered> gathered(groups);
    post_gather(run, pack, k, v, tokens, 0, gathered[0]);
    for (int64_t g = 0; g < groups; ++g) {
      if (g + 1 < groups) post_gather(run, pack, k, v, tokens, g + 1, gathered[g + 1]);
      finish_gather(run, pack, gathered[g]);
      const TensorView qv = q.slice(2, g * qg, (g + 1) * qg);
      const TensorView dov = dout.slice(2, g * qg, (g + 1) * qg);
      const TensorView lv = lse.slice(1, g * qg, (g + 1) * qg);
      const TensorView dlv = delta.view().slice(1, g * qg, (g + 1) * qg);
      const TensorView dqv = dq32.view().slice(2, g * qg, (g + 1) * qg);
      Reduce& red = reduces[g];
      red.recvs.resize(p);
      for (int j = 0; j < p; ++j)
        if (j != r) red.recvs[j] = comm_.irecv(grad_bytes, j, kReduceTag + int(g));
      memory.hold(size_t(p - 1) * grad_bytes);
      for (int j = 0; j < p; ++j) {
        const bool own = j == r;
        const Buffer& c = gathered[g].chunks[j];
        Buffer part(grad_bytes);  // this rank's share of rank j's dK/dV for this head group
        memory.hold(grad_bytes);
        run.busy([&] {
          return attention_backward_block(
              qv, tokens, own ? k.slice(2, g * hg, (g + 1) * hg) : pack.k(c),
              own ? v.slice(2, g * hg, (g + 1) * hg) : pack.v(c), own ? tokens : pack.tokens_of(c),
              run.mask, dov, lv, dlv, dqv, grad.k(part), grad.v(part), run.kernel);
        });
        if (own)
          red.own = std::move(part);
        else
          red.sends.push_back(comm_.isend(std::move(part), j, kReduceTag + int(g)));
      }
      memory.release(2 * size_t(p - 1) * pack.bytes());
      gathered[g] = Gathered();
      if (g > 0) finish_reduce(g - 1);  // its messages travelled during this group's compute
    }
    finish_reduce(groups - 1);
    copy_into(dq32, dq);
    call.finish();
  }

 private:
  int64_t groups_of(const Dims& dims) const {
    return options_.head_groups > 0 ? options_.head_groups : auto_groups(dims.hkv);
  }
  std::string check_groups(const Dims& dims) const {
    if (options_.head_groups > 0 && dims.hkv % options_.head_groups != 0)
      return detail::concat("allgather: head_groups = ", options_.head_groups,
                            " must divide the kv heads Hkv = ", dims.hkv);
    return "";
  }

  void post_gather(Run& run, const KvPacking& pack, const TensorView& k, const TensorView& v,
                   const Tokens& tokens, int64_t g, Gathered& out) {
    const int p = comm_.size(), r = comm_.rank();
    out.chunks.resize(p);
    out.recvs.resize(p);
    const int64_t h0 = g * pack.heads, h1 = h0 + pack.heads;
    for (int j = 0; j < p; ++j)
      if (j != r) out.recvs[j] = comm_.irecv(pack.bytes(), j, int(g));
    for (int i = 1; i < p; ++i) {  // r+1 first, so that no rank is everyone's first target
      const int j = (r + i) % p;
      out.sends.push_back(comm_.isend(pack.pack(k.slice(2, h0, h1), v.slice(2, h0, h1), tokens),
                                      j, int(g)));
    }
    // Held until the group is done: the P-1 chunks coming in and the P-1 copies going out.
    run.memory->hold(size_t(p - 1) * pack.bytes() * 2);
  }

  void finish_gather(Run& run, const KvPacking&, Gathered& g) {
    run.waiting([&] {
      for (int j = 0; j < comm_.size(); ++j)
        if (j != comm_.rank()) g.chunks[j] = g.recvs[j].take();
      for (Request& s : g.sends) s.wait();
    });
    g.sends.clear();
  }
};

}  // namespace

std::unique_ptr<Strategy> make_allgather(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<AllGatherStrategy>(comm, options);
}

}  // namespace ctxpar::strategy
