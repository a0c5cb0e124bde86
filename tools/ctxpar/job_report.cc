// The JSON report of an attention job (`ctxpar attention --json`, `bench cp` rows).
#include <algorithm>

#include "job_internal.h"
#include "options.h"

namespace ctxpar::cli {

using job::kv_heads_of;

namespace {

// One rank's figures (its cuDNN use on the cuda device).
nlohmann::json rank_json(const RankReport& r, bool cuda) {
  nlohmann::json j = {{"rank", r.rank},
                      {"tokens", r.tokens},
                      {"attention_flops", r.attention_flops},
                      {"forward_flops", r.forward_flops},
                      {"backward_flops", r.backward_flops},
                      {"busy_seconds", r.busy_seconds},
                      {"forward_busy_seconds", r.forward_busy_seconds},
                      {"backward_busy_seconds", r.backward_busy_seconds},
                      {"forward_cpu_seconds", r.forward_cpu_seconds},
                      {"backward_cpu_seconds", r.backward_cpu_seconds},
                      {"wall_seconds", r.wall_seconds},
                      {"comm_wait_seconds", r.comm_wait_seconds},
                      {"bytes_sent", r.bytes_sent},
                      {"bytes_received", r.bytes_received},
                      {"peak_bytes", r.peak_bytes},
                      {"shard_bytes", r.shard_bytes},
                      {"input_bytes_read", r.input_bytes_read}};
  if (cuda)
    j["cudnn"] = {{"blocks", r.cudnn_blocks},
                  {"calls", r.cudnn_calls},
                  {"fallback_blocks", r.fallback_blocks},
                  {"refused_blocks", r.cudnn_refused_blocks}};
  return j;
}

// cuDNN's version, or why it is off (CTXPAR_CUDNN, no libcudnn, too old, no GPU); where
// the attention blocks went, over every rank, forward and backward, all repeats.
nlohmann::json cudnn_json(const AttentionResult& result) {
  nlohmann::json c = {
      {"used", !result.cudnn_version.empty()},
      {"version", result.cudnn_version.empty() ? nlohmann::json(nullptr)
                                               : nlohmann::json(result.cudnn_version)},
      {"off_reason", result.cudnn_off_reason.empty() ? nlohmann::json(nullptr)
                                                     : nlohmann::json(result.cudnn_off_reason)}};
  int64_t blocks = 0, calls = 0, fallback = 0, refused = 0;
  for (const auto& r : result.ranks)
    blocks += r.cudnn_blocks, calls += r.cudnn_calls, fallback += r.fallback_blocks,
        refused += r.cudnn_refused_blocks;
  c["blocks"] = blocks, c["calls"] = calls, c["fallback_blocks"] = fallback;
  c["refused_blocks"] = refused;
  return c;
}

// The check's verdict and each quantity's error against its tolerance.
void put_check(const AttentionResult& result, nlohmann::json& j) {
  j["check_passed"] = result.check_passed;
  j["check_seconds"] = result.check_seconds;
  j["max_abs_err"] = result.max_abs_err;
  j["tolerance"] = result.tolerance;
  nlohmann::json q = nlohmann::json::array();
  for (const auto& c : result.checks)
    q.push_back({{"name", c.name},
                 {"max_abs_err", c.max_abs_err},
                 {"naive32_err", c.naive_err},
                 {"tolerance", c.tolerance},
                 {"passed", c.passed}});
  j["check"] = {{"sampled", result.check_sampled},
                {"note", result.check_note},
                {"rule", "max|run - fp64| <= 2 * max|naive fp32 - fp64| + floor"},
                {"quantities", q},
                {"query_rows", result.check_query_rows},
                {"key_rows", result.check_key_rows}};
}

}  // namespace

nlohmann::json to_json(const AttentionJob& job, const AttentionResult& result) {
  nlohmann::json j;
  j["command"] = "attention";
  j["batch"] = job.batch, j["seq"] = job.seq, j["heads"] = job.heads;
  j["kv_heads"] = kv_heads_of(job), j["head_dim"] = job.head_dim;
  j["dtype"] = job.dtype == DType::bf16 ? "bf16" : "fp32";
  j["bf16_tier"] = bf16_tier_name(job.bf16_tier);
  j["mask"] = job.mask.describe();
  j["num_ranks"] = job.ranks;
  j["strategy"] = strategy_name(job.strategy);
  j["ulysses_degree"] = job.strategy == StrategyKind::hybrid
                            ? (job.ulysses_degree ? job.ulysses_degree : job.ranks)
                            : (job.strategy == StrategyKind::ulysses ? job.ranks : 1);
  j["exchange"] = exchange_name(exchange_of(strategy_options(job)));  // auto resolved
  j["layout"] = layout_name(job.layout);
  j["transport"] = transport_name(job.transport);
  j["device"] = device_name(job.device.kind);
  j["threads"] = job.threads;
  j["backward"] = job.backward;
  j["seed"] = job.seed;
  j["repeats"] = job.repeats;
  j["link_gbps"] = job.link.gbytes_per_second;
  j["link_latency_us"] = job.link.latency_us;
  j["forward_seconds"] = result.forward_seconds;
  j["backward_seconds"] = result.backward_seconds;
  double fwd_flops = 0, bwd_flops = 0, max_flops = 0, total_flops = 0;
  nlohmann::json ranks = nlohmann::json::array();
  for (const auto& r : result.ranks) {
    fwd_flops += r.forward_flops, bwd_flops += r.backward_flops;
    total_flops += r.attention_flops, max_flops = std::max(max_flops, r.attention_flops);
    ranks.push_back(rank_json(r, job.device.kind == DeviceKind::cuda));
  }
  j["ranks"] = ranks;
  if (job.device.kind == DeviceKind::cuda) j["cudnn"] = cudnn_json(result);
  j["forward_flops"] = fwd_flops;
  j["backward_flops"] = bwd_flops;
  j["forward_gflops_per_second"] =
      result.forward_seconds > 0 ? fwd_flops / result.forward_seconds * 1e-9 : 0.0;
  j["backward_gflops_per_second"] =
      result.backward_seconds > 0 ? bwd_flops / result.backward_seconds * 1e-9 : 0.0;
  j["load_balance"] = total_flops > 0 ? max_flops / (total_flops / result.ranks.size()) : 1.0;
  j["single_rank_bytes"] = result.single_rank_bytes;
  j["scores_bytes"] = result.scores_bytes;
  if (result.checked) put_check(result, j);
  return j;
}

}  // namespace ctxpar::cli
