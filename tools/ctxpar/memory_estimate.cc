#include "memory_estimate.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "ctxpar/error.h"
#include "ctxpar/memory.h"
#include "ctxpar/strategy_memory.h"

namespace ctxpar::cli {
namespace {

// Per-thread cost beyond the tensors: the stack pages a rank touches and its share of the
// allocator's per-thread arenas.
constexpr double kPerRankOverhead = 1 << 20;
// Every strategy call agrees on its arguments by an allgather of a ~640-byte verdict per rank
// (src/strategy/strategy.cc): on the threads transport all P ranks hold all P verdicts at once.
constexpr double kVerdictBytes = 640;

// One rank's strategy buffers at their peak: the library's model (ctxpar/strategy_memory.h)
// with the options run_rank gives the strategy; a backward job runs a forward first, so the
// larger of the two passes.
double strategy_bytes(const AttentionJob& job) {
  const StrategyOptions options = strategy_options(job);
  AttentionDims dims;
  dims.batch = job.batch;
  dims.seq = layout_padded_tokens(job.layout, job.seq, job.ranks);
  dims.heads = job.heads;
  dims.kv_heads = job.kv_heads ? job.kv_heads : job.heads;
  dims.head_dim = job.head_dim;
  dims.dtype = dims.out_dtype = job.dtype;
  const double forward = attention_buffer_bytes(options, dims, job.ranks, AttentionPass::forward);
  return job.backward ? std::max(forward, attention_buffer_bytes(options, dims, job.ranks,
                                                                 AttentionPass::backward))
                      : forward;
}

}  // namespace

MemoryEstimate estimate_memory(const AttentionJob& job) {
  MemoryEstimate m;
  const double B = static_cast<double>(job.batch), T = static_cast<double>(job.seq);
  const double P = job.ranks, Tl = T / P, D = static_cast<double>(job.head_dim);
  const double Hq = static_cast<double>(job.heads);
  const double Hkv = static_cast<double>(job.kv_heads ? job.kv_heads : job.heads);
  const double es = static_cast<double>(dtype_size(job.dtype));
  // q, out [B, Tl, Hq, D], k, v [B, Tl, Hkv, D] in the job's dtype; lse [B, Hq, Tl] fp32;
  // backward: dout in the dtype, dq, dk, dv fp32 (as run_rank allocates them).
  m.shard_bytes = B * Tl * D * (2 * Hq + 2 * Hkv) * es + B * Hq * Tl * 4;
  if (job.backward) m.shard_bytes += B * Tl * D * (Hq * es + (Hq + 2 * Hkv) * 4);
  m.strategy_bytes = strategy_bytes(job);
  const bool mpi = job.transport != TransportKind::threads;  // one rank per process (mpi, gloo)
  m.ranks_here = mpi ? 1 : job.ranks;
  m.run_bytes = m.ranks_here * (m.shard_bytes + m.strategy_bytes + kPerRankOverhead) +
                double(m.ranks_here) * job.ranks * kVerdictBytes;

  const double full = P * m.shard_bytes;  // every tensor of the whole sequence
  if (job.check || job.keep_outputs) {
    // Threads: the P shards and their unsharded copies. MPI root: its own shard, every
    // rank's gathered shard and the copies.
    m.gather_bytes = mpi ? m.shard_bytes + 2 * full : 2 * full;
  }
  if (job.check) {
    // The shards are freed first; the reference reads the unsharded tensors, (backward) their
    // fp32 copies for the key rows, and keeps fp64 and fp32 results per checked row.
    const double per_row = B * Hq * T * D;
    const double rows = std::min(T, std::max(16.0, std::floor(job.check_budget / per_row)));
    double bytes = full + rows * B * Hq * D * 64;
    if (job.backward)
      bytes += (B * T * D * (3 * Hq + 2 * Hkv) + B * Hq * T) * 4 + rows * B * Hkv * 2 * D * 12;
    m.check_bytes = bytes;
  }
  m.total_bytes = std::max({m.run_bytes, m.gather_bytes, m.check_bytes});
  return m;
}

void check_memory(const AttentionJob& job) {
  const MemoryLimit limit = memory_limit();
  if (!limit.known()) return;
  const MemoryEstimate m = estimate_memory(job);
  if (m.total_bytes <= limit.bytes) return;
  std::string parts = detail::concat(m.ranks_here, " rank", m.ranks_here > 1 ? "s" : "",
                                     " x (shards ", bytes_text(m.shard_bytes),
                                     " + strategy buffers ", bytes_text(m.strategy_bytes), ")");
  if (m.gather_bytes > 0) parts += "; --check/--out gather " + bytes_text(m.gather_bytes);
  if (m.check_bytes > 0) parts += "; --check reference " + bytes_text(m.check_bytes);
  throw Error(detail::concat(
      "this job needs about ", bytes_text(m.total_bytes), " of memory (", parts, ") but ",
      limit.source_text(), " leaves ", bytes_text(limit.bytes), "; ", limit.raise_text(),
      ", or lower --seq, --batch, --heads or --head-dim, use --dtype bf16, drop --check / --out, "
      "or run the ranks on several machines (mpirun)"));
}

}  // namespace ctxpar::cli
