// A whole attention problem on P thread ranks of this process: shard every tensor by the
// layout, run a strategy on each rank, unshard the results. The one copy of that loop: the
// Python package's whole-tensor entry points and the strategy tests call it (`ctxpar
// attention` never holds the whole inputs: each rank draws its own shard, tools/ctxpar).
#pragma once
#include <optional>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/strategy.h"

namespace ctxpar {

// Whole tensors in global token order (T tokens; the layout pads them, docs/layouts.md):
//   q, out, dout, dq [B, T, Hq, D]; k, v, dk, dv [B, T, Hkv, D]; lse [B, Hq, T]
struct WholeAttention {
  TensorView q, k, v;
  Tokens tokens;        // T global positions, and T document ids with a documents mask
  TensorView out, lse;  // forward writes them; a backward alone reads them
  TensorView dout, dq, dk, dv;
  // The dtype of each rank's out, dout, dq, dk, dv shards (dout converted to it); unset: the
  // whole tensor's own.
  std::optional<DType> shard_dtype;
};

// What each rank's strategy reported: forward and backward stats, and the communicator's
// counters after the forward.
struct ThreadsRunStats {
  std::vector<StrategyStats> forward, backward;
  std::vector<CommCounters> counters;
};

// Runs forward and/or backward of the strategy `options` on `ranks` thread ranks (one
// strategy per rank, created once: a backward after a forward reads the ranks' own out and
// lse shards). Rethrows the first failing rank's Error, as run_threads does.
void run_whole_on_threads(int ranks, LayoutKind layout, const StrategyOptions& options,
                          const WholeAttention& whole, bool forward, bool backward,
                          ThreadsRunStats* stats = nullptr, const ThreadsOptions& threads = {});

}  // namespace ctxpar
