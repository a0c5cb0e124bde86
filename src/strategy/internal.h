// Private pieces shared by the strategies: the argument checks and signature the call frame
// agrees on (src/strategy/frame.cc), what a call hands its algorithm, and the two cores that
// hybrid composes (ring over a communicator, and Ulysses' head <-> sequence all-to-all around
// an inner computation). The ring's block and rotation: strategy/ring_steps.h.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/agreement.h"
#include "ctxpar/clock.h"
#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/kernel.h"
#include "ctxpar/strategy.h"
#include "strategy/call_record.h"
#include "strategy/ring_steps.h"

namespace ctxpar::strategy {

// ---- arguments ----------------------------------------------------------------------------

// One rank's problem, read from its arguments.
struct Dims {
  int64_t batch = 0, tokens = 0, hq = 0, hkv = 0, d = 0;
  DType dtype = DType::f32;      // q, k, v storage
  DType out_dtype = DType::f32;  // out (and dout)
  bool documents = false;
};

// Local checks of one rank's forward / backward arguments. Returns "" when fine, else the
// message (never throws, so that the verdict can be shared before anyone gives up).
std::string check_forward(const ForwardArgs& a, const Mask& mask, Dims& dims);
std::string check_backward(const BackwardArgs& a, const Mask& mask, Dims& dims);

// The fields every rank of a call must agree on (require_agreement, ctxpar/agreement.h): the
// options and this rank's shapes, named ("mask", "kv heads Hkv", ...), so that a difference is
// named in the error. ulysses_groups is one of them: it decides which messages Ulysses sends.
Signature signature_of(const Dims& dims, const StrategyOptions& options);

// Non-finite results from finite inputs (scores or gradients beyond the fp32 range): checked
// once the call's results are final, on each rank's own rows, in one pass. A row whose every
// key is masked has LSE = -inf and O = 0: not an error; +inf or NaN LSE, or a NaN / Inf in
// O, dQ, dK or dV, is. The first bad element (lowest batch, global position, head) is kept.
struct BadOutput {
  int64_t batch = -1, position = 0, head = 0;  // batch < 0: nothing bad
  std::string message;                         // "lse = inf at token position 5, batch 0, ..."
  void take(const BadOutput& other);           // keeps the first of the two
};
BadOutput check_forward_outputs(const TensorView& out, const TensorView& lse, const Tokens& tokens);
BadOutput check_backward_outputs(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                 const Tokens& tokens);
// Shares every rank's BadOutput (one small allgather on `comm`, after the call's own
// communication) and throws the same ctxpar::Error on every rank if any rank had one, naming
// the first bad element of the group, so that no rank goes on to wait for one that gave up.
void agree_outputs(Communicator& comm, const std::string& what, const BadOutput& mine);

// ---- per-call bookkeeping -----------------------------------------------------------------

// One call as the algorithm sees it (Note [One call frame] in ctxpar/strategy.h): this rank's
// problem, agreed on by every rank, the device it enqueues on, and how to call the kernel.
// What the call did is measured around it by a CallRecord (strategy/call_record.h).
struct Call {
  Dims dims;
  Device* dev;
  Mask mask;
  KernelConfig kernel;
  double host_wait_seconds = 0;  // blocked in host-side collectives (device waits: counters)

  // A blocking collective on the host: the device is synchronised first, so that no transfer
  // of a stream uses the communicator at the same time (device.h's rules).
  template <typename F>
  void host_collective(F&& f) {
    const double t0 = now_seconds();
    dev->synchronize();
    f();
    host_wait_seconds += now_seconds() - t0;
  }
};

// What every backward starts from (ring and all-gather on their own rows): delta = rowsum(dO * O)
// [B, Hq, T] and a zeroed fp32 dQ accumulator [B, T, Hq, D] (the caller's dq may be bf16),
// enqueued on the compute stream.
struct BackwardRows {
  DeviceBuffer delta_buffer, dq32_buffer;
  TensorView delta, dq32;
  BackwardRows(Call& call, const BackwardArgs& a)
      : delta_buffer(call.dev->alloc(size_t(a.lse.numel()) * 4)),  // lse's [B, Hq, Tl]
        dq32_buffer(call.dev->alloc(size_t(a.q.numel()) * 4)),
        delta(delta_buffer.view(DType::f32, a.lse.shape())),
        dq32(dq32_buffer.view(DType::f32, a.q.shape())) {
    call.dev->fill_zero(kComputeStream, dq32);
    call.dev->backward_delta(kComputeStream, a.out, a.dout, delta, call.kernel);
  }
};

// ---- cores --------------------------------------------------------------------------------

// What a backward core computes on: q's rows (tokens) with the global lse and delta
// [B, Hq, Tq] = rowsum(dO * O), dq an fp32 accumulator [B, Tq, Hq, D] (added to); the K/V
// block k, v [B, Tk, Hkv, D] (the same tokens) with dk, dv fp32, overwritten.
struct GradArgs {
  TensorView q, k, v;
  Tokens tokens;
  TensorView dout, lse, delta;
  TensorView dq, dk, dv;
};

// Ring forward on `comm`: q [B, Tq, Hq, D] stays; k, v [B, Tk, Hkv, D] (with the tokens)
// rotate P-1 times; out [B, Tq, Hq, D], lse [B, Hq, Tq].
void ring_forward(Communicator& comm, Call& call, const ForwardArgs& a);
// Ring backward on `comm`: dk, dv get the gradient of this rank's K/V, summed over every
// rank's queries.
void ring_backward(Communicator& comm, Call& call, const GradArgs& a);
// The same under Exchange::needed (src/strategy/ring_needed.cc): each rank receives only the
// K/V rows its queries can see, straight from their owner; the dK/dV of those rows go back to
// it. The ring strategy's own; hybrid's ring keeps ring_forward / ring_backward. (The
// all-gather's needed exchange: allgather.cc, on the same plan, strategy/needed.h.)
void ring_needed_forward(Communicator& comm, Call& call, const ForwardArgs& a);
void ring_needed_backward(Communicator& comm, Call& call, const GradArgs& a);

// Ulysses around an inner computation on the whole (group) sequence for Hq/P heads. The inner
// receives the sequence of all ranks of `comm`, sorted by global position.
//   forward inner:  ForwardArgs with q [B, T, Hq/P, D], k, v [B, T, Hkv', D],
//                   out [B, T, Hq/P, D] (out's dtype), lse [B, Hq/P, T]
//   backward inner: GradArgs, dq/dk/dv fp32 zeroed.
// The inner runs once per head group (docs/ulysses.md: the all-to-alls of the others travel
// meanwhile), on that group's heads; `max_groups` is the most groups: groups_limit() below
// (hybrid keeps 1 by default: a ring inside would send its token ids once per group).
using UlyssesForwardInner = std::function<void(const ForwardArgs&)>;
using UlyssesBackwardInner = std::function<void(const GradArgs&)>;

// StrategyOptions::ulysses_groups when given (> 0), else the strategy's default.
inline int groups_limit(const StrategyOptions& options, int by_default) {
  return options.ulysses_groups > 0 ? options.ulysses_groups : by_default;
}
void ulysses_forward(Communicator& comm, Call& call, const ForwardArgs& a,
                     const UlyssesForwardInner& inner, int max_groups = 1);
void ulysses_backward(Communicator& comm, Call& call, const BackwardArgs& a,
                      const UlyssesBackwardInner& inner, int max_groups = 1);

// ---- factories (one per file) -------------------------------------------------------------

std::unique_ptr<Strategy> make_ring(Communicator& comm, const StrategyOptions& options,
                                    std::unique_ptr<Device> device);
std::unique_ptr<Strategy> make_allgather(Communicator& comm, const StrategyOptions& options,
                                         std::unique_ptr<Device> device);
std::unique_ptr<Strategy> make_ulysses(Communicator& comm, const StrategyOptions& options,
                                       std::unique_ptr<Device> device);
std::unique_ptr<Strategy> make_hybrid(Communicator& comm, const StrategyOptions& options,
                                      std::unique_ptr<Device> device);

}  // namespace ctxpar::strategy
