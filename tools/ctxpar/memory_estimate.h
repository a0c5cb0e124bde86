// Memory of one `ctxpar attention` job, estimated from its shape before anything is
// allocated, and the check against what the machine has: a job that cannot fit is refused at
// once with the figures, instead of filling gigabytes for a minute before running out.
#pragma once
#include "attention_job.h"

namespace ctxpar::cli {

// Bytes, all in double (a hostile shape must not overflow the estimate itself). Per rank:
// the figures `--json` reports per rank as shard_bytes and peak_bytes.
struct MemoryEstimate {
  double shard_bytes = 0;     // one rank's q, k, v, out, lse (+ dout, dq, dk, dv)
  double strategy_bytes = 0;  // one rank's strategy buffers at their peak (fwd or bwd)
  int ranks_here = 1;         // ranks in this process: P on threads, 1 under MPI
  double run_bytes = 0;       // ranks_here x (shard + strategy + thread) + argument verdicts
  double gather_bytes = 0;    // --check / --out: shards plus the unsharded copies
  double check_bytes = 0;     // --check: unsharded tensors, fp32 copies, fp64 reference rows
  double total_bytes = 0;     // the peak of this process: max of the three phases
};

// strategy_bytes is the library's model (attention_buffer_bytes), equal to the measured
// peak_bytes; with the shards the estimate is at least the measured peak_bytes + shard_bytes
// and at most twice it; tests/cli_io/limits_test.cc checks all three.
MemoryEstimate estimate_memory(const AttentionJob& job);

// Throws ctxpar::Error when the estimate exceeds memory_limit() (ctxpar/memory.h), with both
// figures, the parts of the estimate, the binding limit and what to raise or lower. Under MPI every rank checks the root's figure
// (the largest), so all ranks of one machine give the same verdict.
void check_memory(const AttentionJob& job);

}  // namespace ctxpar::cli
