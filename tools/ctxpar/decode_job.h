// `ctxpar decode`'s run as data (cmd_decode.cc parses and runs it) and its report
// (decode_report.cc: the tables, --plan's prediction, the memory check).
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/hash.h"
#include "ctxpar/inference.h"

namespace ctxpar::cli::decode_cli {

struct DecodeConfig {
  std::vector<int64_t> context;  // per sequence
  int64_t tokens = 16, hq = 8, chunk = 0;
  KvCacheOptions cache;
  bool attend = true;
  PrefillMode mode = PrefillMode::automatic;
  bool merge_auto = true;  // --merge auto: time the merges on the run's ranks, take the fastest
  uint64_t seed = 1;
  std::string k_npy, v_npy;
  bool json = false;
};

struct Report {
  std::vector<double> step_seconds;  // rank 0's decode() wall time per step
  double prefill_seconds = 0, merge_seconds = 0;
  uint64_t prefill_bytes = 0, decode_bytes = 0;  // all ranks together
  std::vector<uint64_t> cache_bytes;             // per rank, at the end
  std::vector<double> cpu_seconds;  // per rank: decode's CPU time (its thread), all steps
  std::string prefill_mode;         // the modes the prefill calls ran ("pass-kv+pass-q"), or "fill"
  DecodeMerge merge = DecodeMerge::allgather;  // the merge decode ran
  DecodeMergeTimes merge_times;                // --merge auto: what it measured (else zeros)
  // FNV-1a of every step's out and lse, which are bitwise the same on every rank and transport
  // for the same P (docs/inference.md, "Decode"): `--json`'s way to compare two runs' answers.
  uint64_t outputs_hash = kFnv1a64Offset;
};

// The run's figures on stdout: a table, or one JSON object (--json).
void print(const DecodeConfig& c, int ranks, const std::string& transport, const Report& r);
// --plan: decode's and prefill's predicted time, bytes and memory per rank, from rates
// measured here.
void print_plan(const DecodeConfig& c, int ranks);
// Refuses (exit 2) a run that needs more than --max-cache-bytes or this process's memory limit,
// naming the figures and the options that make the largest part. `ranks_here`: the ranks in
// this process (P on threads, 1 under a launcher).
void check_decode_memory(const DecodeConfig& c, int ranks, int ranks_here);

}  // namespace ctxpar::cli::decode_cli
