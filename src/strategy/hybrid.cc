// Hybrid (USP): Ulysses inside groups of u consecutive ranks, ring across the P/u groups.
// See docs/hybrid.md.
//
//   P = 4, u = 2:   ulysses group {0,1}   ulysses group {2,3}
//                   ring {0,2} (same head slice), ring {1,3}
//
// Each rank first trades its Tl tokens x Hq heads for the group's u*Tl tokens x Hq/u heads
// (all-to-all in its Ulysses group), then runs the ring over the P/u groups with those blocks,
// then trades back. The communicator is split once, in create().
#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

class HybridStrategy final : public Strategy {
 public:
  HybridStrategy(Communicator& comm, const StrategyOptions& options) : Strategy(comm, options) {
    const int p = comm.size(), r = comm.rank();
    u_ = options.ulysses_degree > 0 ? options.ulysses_degree : p;
    CTXPAR_ASSERT(p % u_ == 0, "create() checks that u divides P");
    ulysses_ = comm.split(r / u_, r % u_);
    ring_ = comm.split(r % u_, r / u_);
  }

  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Tokens& tokens, const TensorView& out, const TensorView& lse) override {
    Dims dims;
    std::string e = check_forward(q, k, v, tokens, out, lse, options_.mask, dims);
    if (e.empty()) e = check_ulysses_heads(dims, u_, "hybrid (ulysses_degree u)");
    CallScope call(comm_, *device_, stats_, options_, "hybrid forward", e, dims,
                   {ulysses_.get(), ring_.get()});
    Run& run = call.run;
    ulysses_forward(*ulysses_, run, dims, q, k, v, tokens, out, lse,
                    [&](const TensorView& qf, const TensorView& kf, const TensorView& vf,
                        const Tokens& tf, const TensorView& of, const TensorView& lf) {
                      ring_forward(*ring_, run, qf, tf, kf, vf, tf, of, lf);
                    },
                    groups_limit(options_, 1));
    call.finish();
    agree_outputs(comm_, "hybrid forward", check_forward_outputs(out, lse, tokens));
  }

  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const Tokens& tokens, const TensorView& out, const TensorView& lse,
                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                const TensorView& dv) override {
    Dims dims;
    std::string e =
        check_backward(q, k, v, tokens, out, lse, dout, dq, dk, dv, options_.mask, dims);
    if (e.empty()) e = check_ulysses_heads(dims, u_, "hybrid (ulysses_degree u)");
    CallScope call(comm_, *device_, stats_, options_, "hybrid backward", e, dims,
                   {ulysses_.get(), ring_.get()});
    Run& run = call.run;
    ulysses_backward(
        *ulysses_, run, dims, q, k, v, tokens, out, lse, dout, dq, dk, dv,
        [&](const TensorView& qf, const TensorView& kf, const TensorView& vf, const Tokens& tf,
            const TensorView& dof, const TensorView& lf, const TensorView& df,
            const TensorView& dqf, const TensorView& dkf, const TensorView& dvf) {
          ring_backward(*ring_, run, qf, tf, kf, vf, tf, dof, lf, df, dqf, dkf, dvf);
        },
        groups_limit(options_, 1));
    call.finish();
    agree_outputs(comm_, "hybrid backward", check_backward_outputs(dq, dk, dv, tokens));
  }

 private:
  int u_ = 1;
  std::unique_ptr<Communicator> ulysses_, ring_;
};

}  // namespace

std::unique_ptr<Strategy> make_hybrid(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<HybridStrategy>(comm, options);
}

}  // namespace ctxpar::strategy
