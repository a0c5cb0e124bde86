// Shared by the strategy tests: a whole attention problem, run sharded on P threads by a
// strategy and gathered back in global token order, and its fp64 / naive fp32 references.
#pragma once
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/reference.h"
#include "ctxpar/strategy.h"

namespace ctxpar::testing {

struct Problem {
  int64_t batch = 1, tokens = 48, hq = 4, hkv = 4, d = 16;
  DType dtype = DType::f32;      // q, k, v storage
  DType out_dtype = DType::f32;  // out, dout, dq, dk, dv as the ranks hold them
  Mask mask;
  uint64_t seed = 1;
  // Filled by build():
  Tensor q, k, v, dout;            // [B, T, H, D] whole sequence
  std::vector<int64_t> positions;  // 0..T-1
  std::vector<int32_t> documents;  // a few documents of uneven length
  void build();
  Tokens token_ids() const { return {positions, documents}; }
};

// Per-rank stats and the gathered (unsharded, global order) outputs of one run.
struct RunResult {
  std::vector<StrategyStats> forward_stats, backward_stats;
  std::vector<CommCounters> counters;  // per rank, after forward only (backward: see below)
  Tensor o, lse, dq, dk, dv;           // [B, T, Hq, D], [B, Hq, T], grads fp32
};

// Shards `problem` with `layout` over P threads, runs forward (and backward when asked) with
// a strategy created from `options`, and gathers the results.
RunResult run_sharded(const Problem& problem, int ranks, LayoutKind layout,
                      const StrategyOptions& options, bool backward = true);

// References of the whole problem (cached per problem description).
struct References {
  reference::Result ref64, naive32;
};
const References& references_of(const Problem& problem);

// Max |x - ref| over one output; -inf == -inf counts as 0.
double max_err(const Tensor& t, const std::vector<double>& ref);
double max_abs(const std::vector<double>& ref);

// Errors of a run's five outputs against the fp64 reference, and the rule's bounds.
struct Errors {
  double o = 0, lse = 0, dq = 0, dk = 0, dv = 0;
};
Errors errors_of(const RunResult& run, const References& refs, bool backward = true);
Errors bounds_of(const References& refs, bool backward = true);  // 2 * naive32 err + floor
double floor_of(const std::vector<double>& ref);

// Runs fn on P threads and returns each rank's error message ("" when it returned normally).
// Ranks catch their own errors, so every rank's verdict is seen, not only the first. `seconds`,
// when given, receives the wall time of the whole run.
std::vector<std::string> errors_on_ranks(int p, const std::function<void(Communicator&)>& fn,
                                         double* seconds = nullptr);

}  // namespace ctxpar::testing
