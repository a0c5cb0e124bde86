// One distributed attention run, as `ctxpar attention`, `ctxpar bench cp` and `ctxpar plan`
// (hardware `local`) use it: make or take the full inputs, shard them by the layout, run the
// strategy on P ranks (threads transport, or this process's rank under mpirun), gather the
// outputs, and check them against the fp64 reference of the whole unsharded problem.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "ctxpar/comm.h"
#include "ctxpar/layout.h"
#include "ctxpar/mask.h"
#include "ctxpar/strategy.h"
#include "ctxpar/tensor.h"

namespace ctxpar::cli {

struct AttentionJob {
  int64_t batch = 1, seq = 4096, heads = 8, kv_heads = 0 /* 0 = heads */, head_dim = 128;
  DType dtype = DType::f32;
  Mask mask;
  std::vector<int64_t> document_lengths;  // --mask documents:len1,len2,... (sum = seq)
  int ranks = 1;
  StrategyKind strategy = StrategyKind::ring;
  int ulysses_degree = 0;
  LayoutKind layout = LayoutKind::contiguous;
  std::string transport = "threads";  // "threads" | "mpi"
  int threads = 1;                    // OpenMP threads per rank
  bool backward = false;
  bool check = false;
  uint64_t seed = 0;
  int repeats = 1;                    // timed repetitions; the figures are of the fastest
  SimulatedLink link;                 // threads transport only
  double timeout_seconds = 300;
  bool keep_outputs = false;          // fill AttentionResult's full tensors (on the root)

  // User inputs, full and unsharded, [B, T, H, D] (empty: seeded random inputs).
  Tensor q, k, v, dout;
  std::vector<int32_t> documents;  // per token (empty: from document_lengths, if any)
  std::vector<int64_t> positions;  // per token (empty: 0..T-1)
};

struct RankReport {
  int rank = 0;
  int64_t tokens = 0;
  double attention_flops = 0;     // forward + backward FLOPs actually computed
  double busy_seconds = 0;
  double wall_seconds = 0;
  double comm_wait_seconds = 0;
  uint64_t bytes_sent = 0, bytes_received = 0;
  size_t peak_bytes = 0;
};

struct AttentionResult {
  bool is_root = true;            // false on MPI ranks other than 0 (they print nothing)
  std::vector<RankReport> ranks;
  double forward_seconds = 0, backward_seconds = 0;  // wall, slowest rank
  double single_rank_bytes = 0;   // memory one rank would need for the whole problem
  bool checked = false, check_passed = false;
  double max_abs_err = 0, tolerance = 0;
  Tensor out, lse, dq, dk, dv;    // full, unsharded, original order (keep_outputs, root only)
};

// Validates the job (same verdict on every rank), throws ctxpar::Error naming what is wrong
// and what would work instead.
void validate(const AttentionJob& job);
AttentionResult run_attention_job(const AttentionJob& job);
nlohmann::json to_json(const AttentionJob& job, const AttentionResult& result);

}  // namespace ctxpar::cli
