// Private pieces shared by the strategies: the argument verdict, per-call statistics, the K/V
// block that travels, and the two cores that hybrid composes (ring over a communicator, and
// Ulysses' head <-> sequence all-to-all around an inner computation).
#pragma once
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/kernel.h"
#include "ctxpar/strategy.h"

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
std::string check_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                          const Tokens& tokens, const TensorView& out, const TensorView& lse,
                          const Mask& mask, Dims& dims);
std::string check_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                           const Tokens& tokens, const TensorView& out, const TensorView& lse,
                           const TensorView& dout, const TensorView& dq, const TensorView& dk,
                           const TensorView& dv, const Mask& mask, Dims& dims);
// Ulysses' head split over `ranks`: "" when Hq % P == 0 (KV heads split when Hkv % P == 0,
// else are replicated to the ranks whose query heads read them).
std::string check_ulysses_heads(const Dims& dims, int ranks, const char* who);

// Every rank contributes its local error ("" if none) and a signature of its shapes and
// options; all ranks then throw the same ctxpar::Error if any rank failed or if signatures
// differ. One small allgather on `comm`, done before any other communication of the call.
void agree(Communicator& comm, const std::string& what, const std::string& local_error,
           const std::vector<int64_t>& signature);
std::vector<int64_t> signature_of(const Dims& dims, const StrategyOptions& options);

// Non-finite results from finite inputs (scores or gradients beyond the fp32 range): checked
// once the call's results are final, on each rank's own rows, in one pass. A row whose every
// key is masked has LSE = -inf and O = 0: not an error; +inf or NaN LSE, or a NaN / Inf in
// O, dQ, dK or dV, is. The first bad element (lowest batch, global position, head) is kept.
struct BadOutput {
  int64_t batch = -1, position = 0, head = 0;  // batch < 0: nothing bad
  std::string message;                          // "lse = inf at token position 5, batch 0, ..."
  void take(const BadOutput& other);            // keeps the first of the two
};
BadOutput check_forward_outputs(const TensorView& out, const TensorView& lse, const Tokens& tokens);
BadOutput check_backward_outputs(const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                 const Tokens& tokens);
// Shares every rank's BadOutput (one small allgather on `comm`, after the call's own
// communication) and throws the same ctxpar::Error on every rank if any rank had one, naming
// the first bad element of the group, so that no rank goes on to wait for one that gave up.
void agree_outputs(Communicator& comm, const std::string& what, const BadOutput& mine);

// ---- per-call bookkeeping -----------------------------------------------------------------

inline double now_seconds() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// What the cores need: the device they enqueue on, and how to call the kernel.
struct Run {
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

// Resets stats and snapshots the device's counters and the byte counters of `comms` at start;
// finish() synchronises the device and writes deltas, wall time and the memory peak.
class CallRecord {
 public:
  CallRecord(StrategyStats& stats, Device& device, std::vector<Communicator*> comms);
  void finish(const Run& run);

 private:
  StrategyStats& stats_;
  Device& device_;
  std::vector<Communicator*> comms_;
  uint64_t sent0_ = 0, received0_ = 0;
  DeviceCounters device0_;
  size_t held0_ = 0;
  double t0_ = 0;
};

// One strategy call's frame: every rank agrees on the argument checks first (before any other
// communication, and before the byte counters are read, so the check's small all-gather is not
// counted in the call's stats); then the call enqueues its work with `run`, and finish()
// waits for the device and records time, bytes and peak memory. A call that throws still
// waits for its queued work before its buffers and the caller's tensors go.
class CallScope {
 public:
  CallScope(Communicator& comm, Device& device, StrategyStats& stats,
            const StrategyOptions& options, const std::string& what, const std::string& error,
            const Dims& dims, std::vector<Communicator*> counted)
      : agreed_((agree(comm, what, error, signature_of(dims, options)), true)),
        record_(stats, device, std::move(counted)),
        run{&device, options.mask, options.kernel} {}
  ~CallScope() {
    if (finished_) return;
    try {
      run.dev->synchronize();
    } catch (...) {  // the exception in flight says what went wrong first
    }
  }
  void finish() {
    finished_ = true;
    record_.finish(run);
  }

 private:
  bool agreed_;  // first member: the agreement happens before the record starts counting
  CallRecord record_;
  bool finished_ = false;

 public:
  Run run;
};

// What every backward starts from (ring and all-gather on their own rows): delta = rowsum(dO * O)
// [B, Hq, T] and a zeroed fp32 dQ accumulator [B, T, Hq, D] (the caller's dq may be bf16),
// enqueued on the compute stream.
struct BackwardRows {
  DeviceBuffer delta_buffer, dq32_buffer;
  TensorView delta, dq32;
  BackwardRows(Device& dev, const Dims& dims, const TensorView& q, const TensorView& out,
               const TensorView& dout, const KernelConfig& kernel)
      : delta_buffer(dev.alloc(size_t(dims.batch * dims.hq * dims.tokens) * 4)),
        dq32_buffer(dev.alloc(size_t(q.numel()) * 4)),
        delta(delta_buffer.view(DType::f32, {dims.batch, dims.hq, dims.tokens})),
        dq32(dq32_buffer.view(DType::f32, q.shape())) {
    dev.fill_zero(kComputeStream, dq32);
    dev.backward_delta(kComputeStream, out, dout, delta, kernel);
  }
};

// ---- the K/V block that travels -----------------------------------------------------------

// [k | v | positions (int64) | documents (int32, only with a documents mask)], k and v
// [B, T, Hkv, D] in their storage dtype. No padding: every section is a multiple of 8 bytes
// because D >= 16.
struct KvPacking {
  int64_t batch, tokens, heads, d;
  DType dtype;
  bool documents;
  size_t kv_bytes() const { return size_t(batch * tokens * heads * d) * dtype_size(dtype); }
  size_t bytes() const { return 2 * kv_bytes() + size_t(tokens) * (8 + (documents ? 4 : 0)); }
  // A new block holding k, v and tokens, packed on `s`.
  DeviceBuffer pack(Device& dev, Stream s, const TensorView& k, const TensorView& v,
                    const Tokens& tokens) const;
  TensorView k(const DeviceBuffer& b) const;
  TensorView v(const DeviceBuffer& b) const;
  Tokens tokens_of(const DeviceBuffer& b) const;
};

// A whole buffer as one flat fp32 tensor (for add / fill_zero).
inline TensorView flat_f32(const DeviceBuffer& b) {
  return b.view(DType::f32, {int64_t(b.size() / 4)});
}

// ---- cores --------------------------------------------------------------------------------

// Ring forward on `comm`: q [B, Tq, Hq, D] stays; k, v [B, Tk, Hkv, D] (with kv_tokens) rotate
// P-1 times; out [B, Tq, Hq, D], lse [B, Hq, Tq].
void ring_forward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                  const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                  const TensorView& out, const TensorView& lse);
// Ring backward on `comm` with the global lse and delta [B, Hq, Tq] of q's rows: dq is an fp32
// accumulator [B, Tq, Hq, D] (added to); dk, dv fp32 [B, Tk, Hkv, D] are overwritten with the
// gradient of this rank's K/V, summed over every rank's queries.
void ring_backward(Communicator& comm, Run& run, const TensorView& q, const Tokens& q_tokens,
                   const TensorView& k, const TensorView& v, const Tokens& kv_tokens,
                   const TensorView& dout, const TensorView& lse, const TensorView& delta,
                   const TensorView& dq, const TensorView& dk, const TensorView& dv);

// Ulysses around an inner computation on the whole (group) sequence for Hq/P heads. The inner
// receives the sequence of all ranks of `comm`, sorted by global position.
//   forward inner:  (q, k, v, tokens, out, lse) with q [B, T, Hq/P, D], k, v [B, T, Hkv', D],
//                   out [B, T, Hq/P, D] (out's dtype), lse [B, Hq/P, T]
//   backward inner: (q, k, v, tokens, dout, lse, delta, dq, dk, dv), dq/dk/dv fp32 zeroed.
// The inner runs once per head group (docs/ulysses.md: the all-to-alls of the others travel
// meanwhile), on that group's heads; `max_groups` is the most groups: groups_limit() below
// (hybrid keeps 1 by default: a ring inside would send its token ids once per group).
using UlyssesForwardInner =
    std::function<void(const TensorView&, const TensorView&, const TensorView&, const Tokens&,
                       const TensorView&, const TensorView&)>;
using UlyssesBackwardInner = std::function<void(
    const TensorView&, const TensorView&, const TensorView&, const Tokens&, const TensorView&,
    const TensorView&, const TensorView&, const TensorView&, const TensorView&, const TensorView&)>;

// StrategyOptions::ulysses_groups when given (> 0), else the strategy's default.
inline int groups_limit(const StrategyOptions& options, int by_default) {
  return options.ulysses_groups > 0 ? options.ulysses_groups : by_default;
}
void ulysses_forward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                     const TensorView& k, const TensorView& v, const Tokens& tokens,
                     const TensorView& out, const TensorView& lse,
                     const UlyssesForwardInner& inner, int max_groups = 1);
void ulysses_backward(Communicator& comm, Run& run, const Dims& dims, const TensorView& q,
                      const TensorView& k, const TensorView& v, const Tokens& tokens,
                      const TensorView& out, const TensorView& lse, const TensorView& dout,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const UlyssesBackwardInner& inner, int max_groups = 1);

// ---- factories (one per file) -------------------------------------------------------------

std::unique_ptr<Strategy> make_ring(Communicator& comm, const StrategyOptions& options);
std::unique_ptr<Strategy> make_allgather(Communicator& comm, const StrategyOptions& options);
std::unique_ptr<Strategy> make_ulysses(Communicator& comm, const StrategyOptions& options);
std::unique_ptr<Strategy> make_hybrid(Communicator& comm, const StrategyOptions& options);

}  // namespace ctxpar::strategy
