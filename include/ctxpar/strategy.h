// Context-parallel attention: exact attention over a sequence split across the ranks of a
// communicator. One file per algorithm under src/strategy/, all behind this one interface.
// See docs/ring.md, docs/allgather.md, docs/ulysses.md, docs/hybrid.md.
//
// Per rank (local shard of Tl = T/P tokens, in the layout's order):
//   q, out, dout, dq   [B, Tl, Hq, D]     fp32 or bf16 (dq fp32 or bf16)
//   k, v, dk, dv       [B, Tl, Hkv, D]
//   lse                [B, Hq, Tl]        fp32
//   tokens             global positions (and document ids) of the Tl local tokens
// Every rank must call forward / backward with the same shapes and options; arguments are
// checked before any communication, with the same verdict on every rank.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device.h"
#include "ctxpar/kernel.h"
#include "ctxpar/mask.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

enum class StrategyKind { ring, allgather, ulysses, hybrid };
const char* strategy_name(StrategyKind k);
StrategyKind parse_strategy(const std::string& name);  // throws listing the valid names

constexpr int kMaxUlyssesGroups = 1024;  // StrategyOptions::ulysses_groups

// How the ring and the all-gather move K/V (docs/ring.md, "Moving only what is needed";
// docs/allgather.md). ring: every block goes around the whole ring (P-1 hops), or all-gather
// gathers every block. needed: each rank sends a peer directly only the 64-row key tiles that
// some query tile of the peer can see (mask_rules.h's classify on tile summaries the ranks
// all-gather once per call; the ring at step s to rank r+s, the all-gather to every peer at
// once), and a pair with nothing to carry moves nothing. automatic ("auto"): needed for the
// ring and the all-gather when the mask restricts by documents or slices, otherwise ring
// (plain, causal and window runs keep their bits). Ulysses and hybrid move every token (auto
// keeps them so; needed is refused for them).
enum class Exchange { automatic, ring, needed };
const char* exchange_name(Exchange e);             // "auto", "ring", "needed"
Exchange parse_exchange(const std::string& name);  // throws listing the valid names

struct StrategyOptions {
  StrategyKind kind = StrategyKind::ring;
  int ulysses_degree = 0;  // hybrid: ranks per Ulysses group u (must divide P); 0 = P
  int head_groups = 0;     // allgather: K/V gathered in this many head groups; 0 = auto
  // ulysses (and hybrid's Ulysses step): the most head groups its all-to-alls are pipelined
  // over, 1..kMaxUlyssesGroups (1 = no pipeline); 0 = the default (ulysses 4, hybrid 1). It
  // decides which messages are sent, not the answer (docs/ulysses.md). The ctxpar command
  // fills it from CTXPAR_ULYSSES_GROUPS; the library reads no environment.
  int ulysses_groups = 0;
  Mask mask;
  KernelConfig kernel;
  DeviceOptions device;  // each rank makes its own device of this kind (default: cpu)
  Exchange exchange = Exchange::automatic;  // ring, allgather: what K/V moves (Exchange above)
};

// The exchange `options` runs: options.exchange with `automatic` resolved (ring or allgather +
// a mask that restricts by documents or slices: needed; anything else: ring). Strategy::create
// resolves it once.
Exchange exchange_of(const StrategyOptions& options);
// Whether `kind` has the needed exchange (ring, allgather); the others refuse it.
bool has_needed_exchange(StrategyKind kind);

// What one rank did in the last call.
struct StrategyStats {
  double attention_flops = 0;    // FLOPs the kernel actually computed (masked tiles skipped)
  double busy_seconds = 0;       // time inside kernel calls
  double wall_seconds = 0;       // whole call
  double comm_wait_seconds = 0;  // host time blocked waiting (cpu: for transfers, the exposed
                                 // communication; sim: for the device)
  uint64_t bytes_sent = 0;
  uint64_t bytes_received = 0;
  size_t peak_bytes = 0;  // largest total of buffers the strategy held at once
};

// The rules the strategies check, exported so that a caller (the ctxpar command) can say them
// in its own words instead of keeping a copy that may disagree: "" when fine, else the reason.
// Ulysses (and hybrid's Ulysses groups of u ranks) split the query heads: Hq % ranks == 0
// (KV heads that do not split are replicated). All-gather's head groups must divide Hkv.
std::string ulysses_heads_rule(int64_t hq, int ranks);
std::string allgather_head_groups_rule(int64_t hkv, int head_groups);
// The head groups all-gather runs in: head_groups when > 0, else the largest divisor of Hkv
// that is <= 4 (the first group's gather is exposed, the rest overlap). The planner models
// the same (src/plan/plan.cc, comm_volume.cc).
int64_t allgather_head_groups(int64_t hkv, int head_groups = 0);
// The ring backward sends its last hop home in pieces of key rows (Note [Pipelined last hop]
// in src/strategy/ring.cc): piece c is rows [cuts[c], cuts[c+1]) of `key_rows`, up to 8
// pieces of at least 512 rows, in whole 64-row kernel tiles (the last may be shorter). The
// rule depends on the problem alone, so every transport computes the same pieces (the same
// bits). The planner models the same.
std::vector<int64_t> ring_last_hop_cuts(int64_t key_rows);

// One call's arguments (shapes: the top of this file). Views and spans: the caller keeps the
// memory alive until the call returns.
struct ForwardArgs {
  TensorView q, k, v;
  Tokens tokens;
  TensorView out, lse;
};
struct BackwardArgs {
  TensorView q, k, v;
  Tokens tokens;
  TensorView out, lse;  // forward's global results
  TensorView dout;
  TensorView dq, dk, dv;  // overwritten (not accumulated)
};

namespace strategy {
struct Call;  // one call's frame and this rank's problem (src/strategy/internal.h)
struct Dims;
}  // namespace strategy

// Note [One call frame]: forward / backward are written once, here in the base class
// (src/strategy/frame.cc): check this rank's arguments, agree on the verdict and on a signature
// of shapes and options with every rank (agreement.h; one small all-gather, not counted in
// last_stats()), reset the stats and the device's memory peak, run the algorithm
// (run_forward / run_backward: one file per algorithm), wait for the device and record the
// stats, then agree on a check of the outputs (non-finite results from finite inputs). An
// algorithm only says what it adds: its extra argument rule and the communicators it counts.
class Strategy {
 public:
  virtual ~Strategy() = default;
  // Builds the strategy for this communicator (hybrid splits it into sub-groups here, once).
  // Collective: every rank of comm calls it with the same options. Throws ctxpar::Error on
  // every rank for invalid options (e.g. ulysses_degree not dividing P) or options that differ
  // between ranks, naming the option. forward / backward are collective too.
  static std::unique_ptr<Strategy> create(Communicator& comm, const StrategyOptions& options);
  // The same on a device of the caller's (nullptr: make_device(options.device, comm.rank())).
  static std::unique_ptr<Strategy> create(Communicator& comm, const StrategyOptions& options,
                                          std::unique_ptr<Device> device);

  void forward(const ForwardArgs& args);
  // Uses the global out and lse of forward. dq, dk, dv are overwritten (not accumulated).
  void backward(const BackwardArgs& args);
  void forward(const TensorView& q, const TensorView& k, const TensorView& v, const Tokens& tokens,
               const TensorView& out, const TensorView& lse) {
    forward(ForwardArgs{q, k, v, tokens, out, lse});
  }
  void backward(const TensorView& q, const TensorView& k, const TensorView& v, const Tokens& tokens,
                const TensorView& out, const TensorView& lse, const TensorView& dout,
                const TensorView& dq, const TensorView& dk, const TensorView& dv) {
    backward(BackwardArgs{q, k, v, tokens, out, lse, dout, dq, dk, dv});
  }

  const StrategyStats& last_stats() const { return stats_; }
  const StrategyOptions& options() const { return options_; }
  Device& device() { return *device_; }

 protected:
  Strategy(Communicator& comm, const StrategyOptions& options, std::unique_ptr<Device> device);
  // The algorithm, on arguments every rank has agreed on; enqueues its work with call.run.
  virtual void run_forward(const ForwardArgs& args, strategy::Call& call) = 0;
  virtual void run_backward(const BackwardArgs& args, strategy::Call& call) = 0;
  // The algorithm's own argument rule ("" when fine), checked after the common ones.
  virtual std::string check_heads(int64_t hq, int64_t hkv) const { return ""; }
  // The communicators whose bytes the stats count (hybrid: its two sub-groups).
  virtual std::vector<Communicator*> counted() { return {&comm_}; }

  Communicator& comm_;
  StrategyOptions options_;
  StrategyStats stats_;
  std::unique_ptr<Device> device_;

 private:
  // The frame: this rank's verdict `error` ("" when fine) is completed by check_heads, agreed
  // on, then `run` runs recorded and `check_outputs(what)` agrees on the outputs.
  void in_frame(const char* call, const strategy::Dims& dims, std::string error,
                const std::function<void(strategy::Call&)>& run,
                const std::function<void(const std::string&)>& check_outputs);
};

}  // namespace ctxpar
