// Shared by the inference tests (threads and MPI): a few sequences prefilled in chunks and then
// decoded, run on P ranks against the spread KV cache, and their fp64 / naive fp32 references.
#pragma once
#include <cstdint>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/inference.h"
#include "ctxpar/reference.h"

namespace ctxpar::testing {

struct Scenario {
  int64_t hq = 4, hkv = 2, d = 16, block = 16;
  DType dtype = DType::f32;  // q, k, v storage and the cache's
  Mask mask = Mask::causal_mask();
  std::vector<int64_t> prefill = {100};  // per sequence: tokens prefilled
  int64_t chunk = 0;                     // prefill in chunks of this many tokens (0: one call)
  int64_t decode_steps = 3, decode_tokens = 1;
  PrefillMode mode = PrefillMode::automatic;
  DecodeMerge merge = DecodeMerge::allgather;  // the cache's
  DeviceKind device = DeviceKind::cpu;
  Bf16Products bf16_products = Bf16Products::automatic;  // the cache's KernelConfig's
  bool decode_in_place = true;                           // KvCacheOptions::decode_in_place
  int threads = 1;                                       // the cache's KernelConfig::threads
  // Decode forks of the prefilled sequences (KvCache::fork: their pages shared with the
  // parents, copied on the first write into a shared one), not the sequences themselves.
  bool fork = false;
  uint64_t seed = 1;
  // Filled by build(): per sequence, the whole sequence [1, N, H, D] and its token ids.
  std::vector<Tensor> q, k, v;
  std::vector<std::vector<int64_t>> positions;
  std::vector<std::vector<int32_t>> documents;
  int64_t sequences() const { return int64_t(prefill.size()); }
  int64_t length(int64_t b) const { return prefill[b] + decode_steps * decode_tokens; }
  void build();
  KvCacheOptions cache_options() const;
};

// What one rank produced: per sequence, out [1, N, Hq, D] and lse [1, Hq, N] fp32 with the
// rows it computed (prefill: its own rows; decode: every row), others zero.
struct RankResult {
  std::vector<Tensor> out, lse;
  std::vector<PrefillMode> modes;  // each prefill call's
  std::vector<InferenceStats> prefill_stats;
  uint64_t prefill_bytes_predicted = 0;  // this rank's share is not predicted: all ranks together
  Bf16Products bf16_products = Bf16Products::automatic;  // as the ranks agreed (the cache's)
};

RankResult run_rank(Communicator& comm, const Scenario& s);
std::vector<RankResult> run_on_threads(const Scenario& s, int ranks);

// Rows of a [1, N, H, D] tensor (contiguous) at `indices`, as [1, m, H, D].
Tensor rows_of(const Tensor& full, const std::vector<int64_t>& indices);

// The combined output of sequence b: prefill rows from the rank that owns them, decode rows
// from rank 0 (the test checks the ranks agree).
struct Combined {
  Tensor out, lse;
};
Combined combine(const std::vector<RankResult>& results, const Scenario& s, int64_t b);

// max |result - ref64| against the accuracy rule, for out and lse of sequence b (rows
// [from, N)); returns "" when both pass, else what failed.
std::string check_accuracy(const Scenario& s, int64_t b, const Combined& c, int64_t from = 0);

}  // namespace ctxpar::testing
