// The one model of how much memory a strategy call holds: the DeviceBuffers and forward
// states src/strategy/*.cc allocates (what Device::peak_bytes() counts, what
// StrategyStats::peak_bytes reports), per rank, at their peak. The planner (plan_memory),
// `ctxpar attention`'s memory check and `ctxpar train`'s all ask it, and
// tests/strategy/memory_model_test.cc holds it equal to the measured peak of every strategy.
// docs/plan.md, "Attention buffers", lists the terms.
#pragma once
#include <cstdint>

#include "ctxpar/strategy.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

// The whole problem as the ranks of one strategy call receive it (after tensor parallelism).
struct AttentionDims {
  int64_t batch = 1;
  int64_t seq = 0;  // tokens of the whole sequence as the layout cut it (padded: T = P * Tl)
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  DType dtype = DType::f32;      // q, k, v storage
  DType out_dtype = DType::f32;  // out and dout
};

enum class AttentionPass { forward, backward };

// Bytes one rank's strategy buffers reach at their peak in one call of `pass`, for the
// strategy, mask (documents travel with the K/V blocks), head groups, Ulysses degree and
// groups and kernel threads of `options`, on `ranks` ranks. In double: a hostile shape must
// not overflow the estimate. The count is deterministic (a buffer counts from its allocation
// to its release by the host, whatever the streams do meanwhile), so the model is exact;
// except for the needed exchange (Exchange::needed) of the ring and the all-gather, whose
// buffers hold the tiles the mask needs: the model is its most, when every tile is needed.
double attention_buffer_bytes(const StrategyOptions& options, const AttentionDims& dims, int ranks,
                              AttentionPass pass);

// Ulysses' head rules, the one home that src/strategy/ulysses.cc and the model both call, on
// one Ulysses group of `ranks`: the KV slots a rank receives (Hkv / P when P divides Hkv, else
// the KV heads its Hq / P query heads read, replicated), and the head groups its all-to-alls
// are pipelined over.
int64_t ulysses_kv_slots(int64_t heads, int64_t kv_heads, int ranks);
int ulysses_pipeline_groups(int64_t heads, int64_t kv_heads, int ranks, int64_t batch, int threads,
                            AttentionPass pass, int limit);
// Whether ring.cc's forward ends with a barrier of its ranks: when P > 2 and the device lends
// sent buffers (Device::lends_sent_buffers: the threads transport on the cpu device), so that
// a rank that failed mid-ring fails every rank. The planner models it from the capability of
// the hardware it plans for (HardwareSpec::lends_sent_buffers), never from a transport name.
inline bool ring_forward_ends_with_barrier(int ranks, bool lends_sent_buffers) {
  return ranks > 2 && lends_sent_buffers;
}

// StrategyOptions::ulysses_groups = 0: the most groups ulysses pipelines over (hybrid: 1).
constexpr int kUlyssesDefaultGroups = 4;

}  // namespace ctxpar
