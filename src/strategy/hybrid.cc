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
  HybridStrategy(Communicator& comm, const StrategyOptions& options, std::unique_ptr<Device> device)
      : Strategy(comm, options, std::move(device)) {
    const int p = comm.size(), r = comm.rank();
    u_ = options.ulysses_degree > 0 ? options.ulysses_degree : p;
    CTXPAR_ASSERT(p % u_ == 0, "create() checks that u divides P");
    ulysses_ = comm.split(r / u_, r % u_);
    ring_ = comm.split(r % u_, r / u_);
  }

 protected:
  std::string check_heads(int64_t hq, int64_t hkv) const override {
    const std::string e = ulysses_heads_rule(hq, u_);
    return e.empty() ? e : "hybrid (ulysses_degree u): " + e;
  }
  std::vector<Communicator*> counted() override { return {ulysses_.get(), ring_.get()}; }

  void run_forward(const ForwardArgs& a, Call& call) override {
    ulysses_forward(
        *ulysses_, call, a, [&](const ForwardArgs& f) { ring_forward(*ring_, call, f); },
        groups_limit(options_, 1));
  }

  void run_backward(const BackwardArgs& a, Call& call) override {
    ulysses_backward(
        *ulysses_, call, a, [&](const GradArgs& g) { ring_backward(*ring_, call, g); },
        groups_limit(options_, 1));
  }

 private:
  int u_ = 1;
  std::unique_ptr<Communicator> ulysses_, ring_;
};

}  // namespace

std::unique_ptr<Strategy> make_hybrid(Communicator& comm, const StrategyOptions& options,
                                      std::unique_ptr<Device> device) {
  return std::make_unique<HybridStrategy>(comm, options, std::move(device));
}

}  // namespace ctxpar::strategy
