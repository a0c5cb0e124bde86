// The ring under Exchange::needed: each rank sends a peer only the K/V rows the peer's queries
// can see (docs/ring.md, "Moving only what is needed").
//
//   once:   all-gather every rank's key/query tile summaries (TileRange per 64 tokens)
//   step s: send rank r+s the tiles of this rank it needs, receive from r-s those this rank
//           needs (both sides know the sizes, a step with nothing to carry moves nothing);
//           the next step's transfer is posted before this step's compute, as in the ring
//
// Which tiles a peer needs is decided by mask_rules.h's classify (the one home of the mask's
// rules): a key tile travels when some query tile of the peer does not classify it as skip
// (the plan and the packing: strategy/needed.h, shared with the all-gather).
// A tile that does not travel is skipped by the kernel anyway, so nothing it would have
// computed is lost. Backward sends the dK/dV of the received rows straight back to their
// owner, which adds them to its own in step order (1, 2, ..., P-1): the same bits on every
// transport and timing. dQ stays local.
#include <optional>

#include "ctxpar/strategy_memory.h"
#include "strategy/needed.h"

namespace ctxpar::strategy {
namespace {

// The peers of step s: this rank sends to r+s and receives from r-s.
int to_peer(const Communicator& comm, int s) { return (comm.rank() + s) % comm.size(); }
int from_peer(const Communicator& comm, int s) {
  return (comm.rank() - s + comm.size()) % comm.size();
}

// The P steps: compute(s, kv) on this rank's own block (s = 0) or on the rows of rank r-s it
// received (nullptr: it needs none), while the next step's rows travel.
void needed_steps(Device& dev, Communicator& comm, const NeededPlan& plan, const KvBlock& own,
                  bool documents, const std::function<void(int, const KvBlock*)>& compute) {
  const int p = comm.size();
  DeviceBuffer block;
  for (int s = 0; s < p; ++s) {
    std::optional<RingHop> hop;
    DeviceBuffer out;  // freed stream-ordered: the send keeps reading it until done
    if (s + 1 < p) {
      const int to = to_peer(comm, s + 1);
      const int64_t n = plan.to_rows(to), in = plan.from_rows(from_peer(comm, s + 1));
      if (n > 0) out = pack_rows(dev, own, plan.to(to), n, documents);
      if (n > 0 || in > 0)
        hop.emplace(dev, comm, n > 0 ? &out : nullptr,
                    in > 0 ? packing_of(own.k, in, documents).bytes() : 0, s + 1, s + 1);
    }
    if (s == 0) {
      compute(0, &own);
    } else {
      const int64_t in = plan.from_rows(from_peer(comm, s));
      const KvBlock kv = in > 0 ? packing_of(own.k, in, documents).block(block) : KvBlock{};
      compute(s, in > 0 ? &kv : nullptr);
    }
    block = hop ? hop->wait() : DeviceBuffer{};
  }
}

class NeededBackward {
 public:
  NeededBackward(Communicator& comm, Call& call, const GradArgs& a)
      : comm_(comm), call_(call), dev_(*call.dev), a_(a), plan_(comm, call, a.tokens, a.k.dim(1)) {}

  void run() {
    const KvPacking mine = grad_of(a_.k, a_.k.dim(1));
    own_ = dev_.alloc(2 * mine.kv_bytes());
    dev_.fill_zero(kComputeStream, flat_f32(own_));
    needed_steps(dev_, comm_, plan_, {a_.k, a_.v, a_.tokens}, call_.mask.documents,
                 [&](int s, const KvBlock* kv) { step(s, kv); });
    add_home();
    dev_.copy(kComputeStream, mine.k(own_), a_.dk);
    dev_.copy(kComputeStream, mine.v(own_), a_.dv);
  }

 private:
  void compute(const KvBlock& kv, const KvPacking& grad, const DeviceBuffer& into) {
    dev_.backward_block(kComputeStream, a_.q, a_.tokens, kv.k, kv.v, kv.tokens, call_.mask, a_.dout,
                        a_.lse, a_.delta, a_.dq, grad.k(into), grad.v(into), call_.kernel);
  }

  // Step s: the gradients of rank r-s's rows go back to it, those of this rank's rows that
  // r+s computed come home; the previous step's are added once this step's compute is queued
  // (their transfer hid behind it).
  void step(int s, const KvBlock* kv) {
    if (s == 0) return compute(*kv, grad_of(a_.k, a_.k.dim(1)), own_);
    DeviceBuffer part;
    if (kv) {
      const KvPacking grad = grad_of(a_.k, kv->k.dim(1));
      part = dev_.alloc(2 * grad.kv_bytes());
      dev_.fill_zero(kComputeStream, flat_f32(part));
      compute(*kv, grad, part);
    }
    const int64_t back = plan_.to_rows(to_peer(comm_, s));
    std::optional<RingHop> hop;
    if (kv || back > 0)
      hop.emplace(dev_, comm_, kv ? &part : nullptr,
                  back > 0 ? 2 * grad_of(a_.k, back).kv_bytes() : 0, kRingGradTag + s, -s);
    add_home();
    if (hop) pending_.emplace(std::move(*hop)), pending_step_ = s;
  }

  // Adds the gradients that came home for the pending step into this rank's own, run by run.
  void add_home() {
    if (!pending_) return;
    const DeviceBuffer home = pending_->wait();
    const int s = pending_step_;
    pending_.reset();
    if (home.empty()) return;
    const int to = to_peer(comm_, s);
    add_runs(dev_, grad_of(a_.k, plan_.to_rows(to)), home, grad_of(a_.k, a_.k.dim(1)), own_,
             plan_.to(to));
  }

  Communicator& comm_;
  Call& call_;
  Device& dev_;
  const GradArgs& a_;
  const NeededPlan plan_;
  DeviceBuffer own_;
  std::optional<RingHop> pending_;  // the gradients of step pending_step_, on their way
  int pending_step_ = 0;
};

}  // namespace

void ring_needed_forward(Communicator& comm, Call& call, const ForwardArgs& a) {
  Device& dev = *call.dev;
  const NeededPlan plan(comm, call, a.tokens, a.k.dim(1));
  DeviceForwardState state(dev, a.q.dim(0), a.q.dim(1), a.q.dim(2), a.q.dim(3));
  needed_steps(dev, comm, plan, {a.k, a.v, a.tokens}, call.mask.documents,
               [&](int, const KvBlock* kv) {
                 if (kv)
                   dev.forward_block(kComputeStream, a.q, a.tokens, kv->k, kv->v, kv->tokens,
                                     call.mask, state.get(), call.kernel);
               });
  dev.forward_finalize(kComputeStream, state.get(), a.out, a.lse, call.kernel);
  // As ring_forward: a lent block lives until its last holder lets go, and a rank that failed
  // mid-exchange fails every rank here, naming it.
  if (ring_forward_ends_with_barrier(comm.size(), dev.lends_sent_buffers(comm))) {
    dev.wait(kCommStream, dev.record(kComputeStream));
    dev.barrier(kCommStream, comm);
  }
}

void ring_needed_backward(Communicator& comm, Call& call, const GradArgs& a) {
  NeededBackward(comm, call, a).run();
}

}  // namespace ctxpar::strategy
