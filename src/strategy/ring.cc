// Ring attention: every rank keeps its queries; K/V blocks travel around the ring so that after
// P-1 hops each rank has seen every block. See docs/ring.md (and its
// "Note [load balance for causal masks]").
//
//   step s: rank r holds the block of rank (r - s) mod P
//           post  send(block -> r+1), recv(block of r-s-1 <- r-1)     (for step s+1)
//           compute q_r x block                                        (overlaps the transfer)
//           wait
//
// Backward adds a second ring for the fp32 dK/dV accumulators: the accumulator of block j is
// created by its first visitor (rank j+1), added to by every rank that holds block j and sent
// on after that rank's compute, so after P-1 hops it is back at rank j, which adds it to its
// own contribution. Each rank computes its share into a local buffer first and adds it to the
// travelling accumulator afterwards, so that accumulator transfers hide behind compute.
#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

constexpr int kGradTag = 16384;  // dK/dV messages: kGradTag + step; K/V messages: step

KvPacking packing_of(const TensorView& k, bool documents) {
  return {k.dim(0), k.dim(1), k.dim(2), k.dim(3), k.dtype(), documents};
}

// Moves equal-sized blocks one hop around the ring of `comm` (ring-flash-attention's RingComm):
// send_recv() enqueues on the comm stream, after the compute stream's work so far (which may
// have written the block), the send of `block` to rank r+1 and the receive of the next block
// from rank r-1; wait() makes the compute stream wait for both and hands over the received
// block. The sent block stays readable: the caller keeps it while it computes on it.
class RingComm {
 public:
  RingComm(Device& dev, Communicator& comm, size_t bytes, int tag_base)
      : dev_(dev), comm_(comm), bytes_(bytes), tag_base_(tag_base),
        next_((comm.rank() + 1) % comm.size()),
        prev_((comm.rank() + comm.size() - 1) % comm.size()) {}

  void send_recv(DeviceBuffer& block, int step) {
    dev_.wait(kCommStream, dev_.record(kComputeStream));
    incoming_ = dev_.recv(kCommStream, comm_, bytes_, prev_, tag_base_ + step);
    dev_.send(kCommStream, comm_, block, next_, tag_base_ + step);
    arrived_ = dev_.record(kCommStream);
  }
  DeviceBuffer wait() {
    if (!ring_skip_wait_for_testing()) dev_.wait(kComputeStream, arrived_);
    return std::move(incoming_);
  }

 private:
  Device& dev_;
  Communicator& comm_;
  size_t bytes_;
  int tag_base_, next_, prev_;
  DeviceBuffer incoming_;
  Event arrived_;
};

}  // namespace

void ring_forward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                  const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                  const TensorView& out, const TensorView& lse) {
  // q, out [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; lse [B, Hq, Tq]
  Device& dev = *run.dev;
  const int p = comm.size();
  const KvPacking pack = packing_of(k, run.mask.documents);
  DeviceForwardState state(dev, q.dim(0), q.dim(1), q.dim(2), q.dim(3));
  RingComm ring(dev, comm, pack.bytes(), 0);

  // Step 0 computes on the caller's k, v directly; step s on `block`, the block of rank r-s,
  // which is also the one in flight to the next rank (sent before the compute: it overlaps).
  DeviceBuffer block;
  if (p > 1) block = pack.pack(dev, kComputeStream, k, v, kv_tokens);
  for (int s = 0; s < p; ++s) {
    if (s + 1 < p) ring.send_recv(block, s + 1);
    if (s == 0)
      dev.forward_block(kComputeStream, q, q_tokens, k, v, kv_tokens, run.mask, state.get(),
                        run.kernel);
    else
      dev.forward_block(kComputeStream, q, q_tokens, pack.k(block), pack.v(block),
                        pack.tokens_of(block), run.mask, state.get(), run.kernel);
    if (s + 1 < p) block = ring.wait();  // the block just computed on is freed stream-ordered
  }
  dev.forward_finalize(kComputeStream, state.get(), out, lse, run.kernel);
  // When sends lend their memory (threads transport on cpu), a forwarded block's final owner
  // (the rank holding it at step P-1) must not free it while a rank that forwarded it earlier
  // may still be computing on it. Nothing else orders those two ranks in forward: wait for all.
  if (p > 2 && dev.lends_sent_buffers(comm)) {
    dev.wait(kCommStream, dev.record(kComputeStream));
    dev.barrier(kCommStream, comm);
  }
}

void ring_backward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                   const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                   const TensorView& dout, const TensorView& lse, const TensorView& delta,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  // q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D]; lse, delta [B, Hq, Tq]
  Device& dev = *run.dev;
  const int p = comm.size();
  const KvPacking pack = packing_of(k, run.mask.documents);
  const KvPacking grad{k.dim(0), k.dim(1), k.dim(2), k.dim(3), DType::f32, false};
  const size_t grad_bytes = 2 * grad.kv_bytes();  // [dk | dv] fp32, no tokens
  RingComm kv_ring(dev, comm, pack.bytes(), 0), grad_ring(dev, comm, grad_bytes, kGradTag);

  DeviceBuffer block;
  if (p > 1) block = pack.pack(dev, kComputeStream, k, v, kv_tokens);
  // Step 0 (this rank's own block) adds into `own`, which never travels. The accumulator of
  // block r-s starts on its first visitor after the owner (step 1) and moves on after every
  // step: P-1 hops bring it home, where it is added to `own`. From step 2 on, a step computes
  // into a local `part` while the accumulator is still in flight from the previous rank, and
  // adds `part` into it only after the compute: the accumulator's transfer hides behind the
  // compute instead of being waited for before it (one more fp32 buffer per rank).
  DeviceBuffer own = dev.alloc(grad_bytes), acc, part;
  dev.fill_zero(kComputeStream, flat_f32(own));
  for (int s = 0; s < p; ++s) {
    if (s + 1 < p) kv_ring.send_recv(block, s + 1);
    if (s == 1) {
      acc = dev.alloc(grad_bytes);
      dev.fill_zero(kComputeStream, flat_f32(acc));
    } else if (s >= 2) {
      if (part.empty()) part = dev.alloc(grad_bytes);
      dev.fill_zero(kComputeStream, flat_f32(part));
    }
    const DeviceBuffer& into = s == 0 ? own : s == 1 ? acc : part;
    if (s == 0)
      dev.backward_block(kComputeStream, q, q_tokens, k, v, kv_tokens, run.mask, dout, lse, delta,
                         dq, grad.k(into), grad.v(into), run.kernel);
    else
      dev.backward_block(kComputeStream, q, q_tokens, pack.k(block), pack.v(block),
                         pack.tokens_of(block), run.mask, dout, lse, delta, dq, grad.k(into),
                         grad.v(into), run.kernel);
    if (s > 1) {  // the accumulator left the previous rank after its compute on this block
      acc = grad_ring.wait();
      dev.add(kComputeStream, flat_f32(part), flat_f32(acc));
    }
    if (s > 0) grad_ring.send_recv(acc, s + 1);  // after the last step: our own, coming home
    if (s + 1 < p) block = kv_ring.wait();
  }
  if (p > 1) {
    DeviceBuffer home = grad_ring.wait();
    dev.add(kComputeStream, flat_f32(home), flat_f32(own));
  }
  dev.copy(kComputeStream, grad.k(own), dk);
  dev.copy(kComputeStream, grad.v(own), dv);
}

namespace {

class RingStrategy final : public Strategy {
 public:
  RingStrategy(Communicator& comm, const StrategyOptions& options) : Strategy(comm, options) {}

  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Tokens& tokens, const TensorView& out, const TensorView& lse) override {
    Dims dims;
    std::string e = check_forward(q, k, v, tokens, out, lse, options_.mask, dims);
    CallScope call(comm_, *device_, stats_, options_, "ring forward", e, dims, {&comm_});
    ring_forward(comm_, call.run, q, tokens, k, v, tokens, out, lse);
    call.finish();
  }

  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const Tokens& tokens, const TensorView& out, const TensorView& lse,
                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                const TensorView& dv) override {
    Dims dims;
    std::string e =
        check_backward(q, k, v, tokens, out, lse, dout, dq, dk, dv, options_.mask, dims);
    CallScope call(comm_, *device_, stats_, options_, "ring backward", e, dims, {&comm_});
    Device& dev = *device_;
    const BackwardRows rows(dev, dims, q, out, dout, options_.kernel);
    ring_backward(comm_, call.run, q, tokens, k, v, tokens, dout, lse, rows.delta, rows.dq32, dk,
                  dv);
    dev.copy(kComputeStream, rows.dq32, dq);
    call.finish();
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ring(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<RingStrategy>(comm, options);
}

}  // namespace ctxpar::strategy
