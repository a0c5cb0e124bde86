// Private to the attention job library (job_*.cc): one rank's data, the sequence's token
// identity, and the pieces the run, the MPI gather and the report share.
#pragma once
#include <chrono>
#include <cstdint>
#include <vector>

#include "attention_job.h"

namespace ctxpar::cli::job {

using Clock = std::chrono::steady_clock;

inline int64_t kv_heads_of(const AttentionJob& job) {
  return job.kv_heads ? job.kv_heads : job.heads;
}

// One rank's tensors and measurements. Under threads, rank r's thread fills all_data[r].
struct RankData {
  Tensor q, k, v, dout, out, lse, dq, dk, dv;  // shards, layout order
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
  int64_t tokens = 0;
  size_t shard_bytes = 0;
  uint64_t input_bytes_read = 0;
  std::vector<double> fwd_wall, bwd_wall, fwd_cpu, bwd_cpu;
  std::vector<StrategyStats> fwd_stats, bwd_stats;
  int64_t cudnn_blocks = 0, cudnn_calls = 0, fallback_blocks = 0, cudnn_refused_blocks = 0;
};

// The whole sequence's token identity (T entries): positions and document ids.
struct SequenceTokens {
  std::vector<int64_t> positions;
  std::vector<int32_t> documents;
};

SequenceTokens sequence_tokens(const AttentionJob& job);
// The job's layout over the whole sequence (the balanced layout balances the job's mask over
// `seq`'s positions and documents).
Layout job_layout(const AttentionJob& job, const SequenceTokens& seq);

// One rank's part (job_rank.cc): shard or draw its inputs, run the strategy forward (and
// backward) job.repeats times, time each call.
void run_rank(Communicator& comm, const AttentionJob& job, const SequenceTokens& seq, RankData& rd);

// MPI (job_gather.cc): every rank's measurements, and its tensors when `tensors`, to rank 0.
void gather_to_root(Communicator& comm, const AttentionJob& job, RankData& mine,
                    std::vector<RankData>& all, bool tensors);
// Index of the repeat whose slowest rank was fastest.
int fastest_repeat(const std::vector<RankData>& all, bool backward_phase);
// Full tensor of the shards' field `f`, in original token order.
Tensor unshard_field(const Layout& layout, std::vector<RankData>& all, Tensor RankData::*f,
                     int token_dim);

}  // namespace ctxpar::cli::job
