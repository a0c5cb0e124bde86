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
#include <cstring>

#include "strategy/internal.h"

namespace ctxpar::strategy {
namespace {

constexpr int kGradTag = 16384;  // dK/dV messages: kGradTag + step; K/V messages: step

KvPacking packing_of(const TensorView& k, bool documents) {
  return {k.dim(0), k.dim(1), k.dim(2), k.dim(3), k.dtype(), documents};
}

}  // namespace

void ring_forward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                  const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                  const TensorView& out, const TensorView& lse) {
  // q, out [B, Tq, Hq, D]; k, v [B, Tk, Hkv, D]; lse [B, Hq, Tq]
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  const KvPacking pack = packing_of(k, run.mask.documents);
  ForwardState state(q.dim(0), q.dim(1), q.dim(2), q.dim(3));
  run.memory->hold(state.bytes());

  // Step 0 computes on the caller's k, v directly; later steps on the received buffer. The
  // buffer just computed on is also the one in flight to the next rank: on the threads
  // transport that is the same memory (no copy), read by both ranks.
  TensorView cur_k = k, cur_v = v;
  Tokens cur_tokens = kv_tokens;
  Buffer outgoing;  // what is sent next (owned until it is handed to isend)
  Buffer current;   // the received block computed on in this step (when it is not sent on)
  if (p > 1) {
    outgoing = pack.pack(k, v, kv_tokens);
    run.memory->hold(pack.bytes());
  }
  for (int s = 0; s < p; ++s) {
    Request send, recv;
    if (s + 1 < p) {  // post step s+1's transfer before step s's compute (double buffer)
      recv = comm.irecv(pack.bytes(), prev, s + 1);
      run.memory->hold(pack.bytes());
      send = comm.isend(std::move(outgoing), next, s + 1);
    }
    run.busy([&] {
      return attention_forward_block(q, q_tokens, cur_k, cur_v, cur_tokens, run.mask, state,
                                     run.kernel);
    });
    if (s + 1 < p) {
      Buffer incoming;
      run.waiting([&] {
        incoming = recv.take();
        send.wait();
      });
      send = Request();  // on MPI the sent block is freed here, after its compute
      run.memory->release(pack.bytes());
      cur_k = pack.k(incoming);
      cur_v = pack.v(incoming);
      cur_tokens = pack.tokens_of(incoming);
      if (s + 2 < p)
        outgoing = std::move(incoming);  // forwarded at the top of the next step
      else
        current = std::move(incoming);  // the last block: computed on, never sent
    }
  }
  run.busy([&] {
    attention_forward_finalize(state, out, lse, run.kernel);
    return KernelStats{};
  });
  // On the threads transport a forwarded block is shared memory; its final owner (the rank
  // holding it at step P-1) must not free it while a rank that forwarded it earlier may still
  // be computing on it. Nothing else orders those two ranks in forward, so wait for all.
  if (p > 2 && comm.transport() == "threads") run.waiting([&] { comm.barrier(); });
  current = Buffer();
}

void ring_backward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                   const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                   const TensorView& dout, const TensorView& lse, const TensorView& delta,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  // q, dout, dq [B, Tq, Hq, D]; k, v, dk, dv [B, Tk, Hkv, D]; lse, delta [B, Hq, Tq]
  const int p = comm.size(), r = comm.rank();
  const int next = (r + 1) % p, prev = (r + p - 1) % p;
  const KvPacking pack = packing_of(k, run.mask.documents);
  const KvPacking grad{k.dim(0), k.dim(1), k.dim(2), k.dim(3), DType::f32, false};
  const size_t grad_bytes = 2 * grad.kv_bytes();  // [dk | dv] fp32, no tokens

  TensorView cur_k = k, cur_v = v;
  Tokens cur_tokens = kv_tokens;
  Buffer outgoing, current;
  if (p > 1) {
    outgoing = pack.pack(k, v, kv_tokens);
    run.memory->hold(pack.bytes());
  }
  // Step 0 (this rank's own block) adds into `own`, which never travels. The accumulator of
  // block r-s starts on its first visitor after the owner (step 1) and moves on after every
  // step: P-1 hops bring it home, where it is added to `own`. From step 2 on, a step computes
  // into a local `part` while the accumulator is still in flight from the previous rank, and
  // adds `part` into it only after the compute: the accumulator's transfer hides behind the
  // compute instead of being waited for before it (one more fp32 buffer per rank).
  Buffer own(grad_bytes), acc, part;
  run.memory->hold(grad_bytes);
  Request grad_recv, grad_send;
  for (int s = 0; s < p; ++s) {
    Request send, recv;
    if (s + 1 < p) {
      recv = comm.irecv(pack.bytes(), prev, s + 1);
      run.memory->hold(pack.bytes());
      send = comm.isend(std::move(outgoing), next, s + 1);
    }
    if (s == 1) {
      acc = Buffer(grad_bytes);
      run.memory->hold(grad_bytes);
    } else if (s == 2) {
      part = Buffer(grad_bytes);
      run.memory->hold(grad_bytes);
    } else if (s > 2) {
      std::memset(part.data(), 0, grad_bytes);
    }
    const Buffer& into = s == 0 ? own : s == 1 ? acc : part;
    run.busy([&] {
      return attention_backward_block(q, q_tokens, cur_k, cur_v, cur_tokens, run.mask, dout, lse,
                                      delta, dq, grad.k(into), grad.v(into), run.kernel);
    });
    if (s > 1) {  // the accumulator left the previous rank after its compute on this block
      run.waiting([&] { acc = grad_recv.take(); });
      float* a = acc.as<float>();
      const float* b = part.as<const float>();
      for (size_t i = 0; i < grad_bytes / 4; ++i) a[i] += b[i];  // fixed order: bitwise stable
    }
    if (s > 0) {  // step s+1's accumulator (after the last step: our own, coming home)
      grad_recv = comm.irecv(grad_bytes, prev, kGradTag + s + 1);
      run.memory->hold(grad_bytes);
      run.waiting([&] { grad_send.wait(); });
      if (grad_send.valid()) run.memory->release(grad_bytes);
      grad_send = comm.isend(std::move(acc), next, kGradTag + s + 1);
    }
    if (s + 1 < p) {
      Buffer incoming;
      run.waiting([&] {
        incoming = recv.take();
        send.wait();
      });
      send = Request();
      run.memory->release(pack.bytes());
      cur_k = pack.k(incoming);
      cur_v = pack.v(incoming);
      cur_tokens = pack.tokens_of(incoming);
      if (s + 2 < p)
        outgoing = std::move(incoming);
      else
        current = std::move(incoming);
    }
  }
  if (p > 1) {
    Buffer home;
    run.waiting([&] {
      home = grad_recv.take();
      grad_send.wait();
    });
    grad_send = Request();
    float* o = own.as<float>();
    const float* h = home.as<const float>();
    for (size_t i = 0; i < grad_bytes / 4; ++i) o[i] += h[i];  // fixed order: bitwise stable
    run.memory->release(2 * grad_bytes);
    if (!part.empty()) run.memory->release(grad_bytes);
  }
  copy_into(grad.k(own), dk);
  copy_into(grad.v(own), dv);
}

namespace {

class RingStrategy final : public Strategy {
 public:
  RingStrategy(Communicator& comm, const StrategyOptions& options) : Strategy(comm, options) {}

  void forward(const TensorView& q, const TensorView& k, const TensorView& v,
               const Tokens& tokens, const TensorView& out, const TensorView& lse) override {
    Dims dims;
    std::string e = check_forward(q, k, v, tokens, out, lse, options_.mask, dims);
    CallScope call(comm_, stats_, options_, "ring forward", e, dims, {&comm_});
    Run& run = call.run;
    ring_forward(comm_, run, q, tokens, k, v, tokens, out, lse);
    call.finish();
  }

  void backward(const TensorView& q, const TensorView& k, const TensorView& v,
                const Tokens& tokens, const TensorView& out, const TensorView& lse,
                const TensorView& dout, const TensorView& dq, const TensorView& dk,
                const TensorView& dv) override {
    Dims dims;
    std::string e =
        check_backward(q, k, v, tokens, out, lse, dout, dq, dk, dv, options_.mask, dims);
    CallScope call(comm_, stats_, options_, "ring backward", e, dims, {&comm_});
    Run& run = call.run;
    MemoryTracker& memory = call.memory;
    Tensor delta(DType::f32, {dims.batch, dims.hq, dims.tokens});
    Tensor dq32(DType::f32, q.shape());
    memory.hold(delta.bytes() + dq32.bytes());
    run.busy([&] {
      attention_backward_delta(out, dout, delta, options_.kernel);
      return KernelStats{};
    });
    ring_backward(comm_, run, q, tokens, k, v, tokens, dout, lse, delta, dq32, dk, dv);
    copy_into(dq32, dq);
    call.finish();
  }
};

}  // namespace

std::unique_ptr<Strategy> make_ring(Communicator& comm, const StrategyOptions& options) {
  return std::make_unique<RingStrategy>(comm, options);
}

}  // namespace ctxpar::strategy
