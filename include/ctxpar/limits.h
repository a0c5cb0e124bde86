// Ranges every front end checks its numbers against (docs/cli.md, "Number ranges"): the
// command's options (tools/ctxpar/options.h) and the Python package's arguments
// (python/ctxpar/_checks.py reads them through the extension, `_ctxpar._limits`). A value
// outside its range is refused naming the argument and the range, never wrapped or clamped.
// The transport's and the strategies' own limits live with them: kMaxThreadsRanks (comm.h),
// kMaxUlyssesGroups (strategy.h).
#pragma once
#include <cstdint>

namespace ctxpar {

constexpr int64_t kMaxTokens = int64_t{1} << 40;  // tokens of a sequence: past any machine's memory
constexpr int64_t kMaxHeads = 1 << 16;            // heads, kv heads, head groups
constexpr int64_t kMaxBatch = 1 << 20;            // sequences of a batch, of a KV cache
constexpr int kMaxThreads = 1024;                 // OpenMP threads per rank
constexpr int kMaxProcesses = 1 << 20;            // MPI ranks, parallel degrees (ulysses_degree)
constexpr double kMinTimeout = 1e-3, kMaxTimeout = 1e6;  // a communication timeout, seconds

}  // namespace ctxpar
