// `ctxpar bench cp`: sweeps sequence lengths x ranks x strategies x layouts through the same
// attention job as `ctxpar attention` (attention_job.h), writes one row per run to
// results.json and results.csv after every run (so Ctrl-C keeps what finished), prints a
// short table, and draws the plots with scripts/plot_cp.py. See docs/cli-files.md.
#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "attention_job.h"
#include "bench_cp_files.h"
#include "ctxpar/memory.h"
#include "options.h"
#include "progress.h"

namespace ctxpar::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

struct Combo {
  int64_t seq;
  int ranks;
  StrategyKind strategy;
  LayoutKind layout;
  std::string name() const {
    return detail::concat("T=", seq, " P=", ranks, " ", strategy_name(strategy), "/",
                          layout_name(layout));
  }
};

// ---- the table on stdout ----------------------------------------------------------------

double num(const json& j, const char* key) {
  auto it = j.find(key);
  return it != j.end() && it->is_number() ? it->get<double>() : 0.0;
}

void print_table(const std::vector<json>& rows, bool backward) {
  std::printf("\n%8s %3s %-10s %-10s %10s", "seq", "P", "strategy", "layout", "fwd ms");
  if (backward) std::printf(" %10s", "bwd ms");
  std::printf(" %9s %8s %11s %9s %8s %6s\n", "GFLOP/s", "balance", "MiB/rank", "vs 1 rank",
              "exposed", "check");
  for (const json& r : rows) {
    double peak = 0, wall = 0, wait = 0;
    for (const json& rk : r.value("ranks", json::array())) {
      peak = std::max(peak, num(rk, "peak_bytes") + num(rk, "shard_bytes"));
      wall += num(rk, "wall_seconds"), wait += num(rk, "comm_wait_seconds");
    }
    const double single = num(r, "single_rank_bytes");
    std::printf("%8lld %3lld %-10s %-10s %10.2f", static_cast<long long>(num(r, "seq")),
                static_cast<long long>(num(r, "num_ranks")), r.value("strategy", "?").c_str(),
                r.value("layout", "?").c_str(), num(r, "forward_seconds") * 1e3);
    if (backward) std::printf(" %10.2f", num(r, "backward_seconds") * 1e3);
    std::printf(" %9.1f %8.2f %11.1f %8.1f%% %7.1f%% %6s\n", num(r, "forward_gflops_per_second"),
                num(r, "load_balance"), peak / (1 << 20), single > 0 ? 100 * peak / single : 0.0,
                wall > 0 ? 100 * wait / wall : 0.0,
                !r.contains("check_passed")     ? "-"
                : r["check_passed"].get<bool>() ? "pass"
                                                : "FAIL");
  }
  std::printf(
      "\nGFLOP/s: forward attention FLOPs computed / wall time of the slowest rank. "
      "balance: busiest rank's FLOPs / mean (1.00 is even).\nMiB/rank: largest rank's "
      "shards + strategy buffers; vs 1 rank: that, as a share of what one rank would need "
      "alone. exposed: time ranks waited for communication.\n");
}

// ---- the sweep --------------------------------------------------------------------------

template <typename Parse>
auto parse_list(const Options& opts, const std::string& name, Parse parse) {
  std::vector<decltype(parse(std::string()))> out;
  for (const auto& item : opts.list(name)) {
    try {
      out.push_back(parse(item));
    } catch (const UsageError&) {
      throw;
    } catch (const Error& e) {
      throw UsageError("--" + name + ": " + e.what());
    }
  }
  if (out.empty()) throw UsageError("--" + name + " needs at least one value");
  return out;
}

// What the sweep varies and what it keeps (the options, checked: a UsageError naming one).
struct Sweep {
  std::vector<int64_t> seqs;
  std::vector<int> ranks;
  std::vector<StrategyKind> strategies;
  std::vector<LayoutKind> layouts;
  AttentionJob base;
  int ulysses_degree = 0;  // hybrid's
};

// The runs in order, and the combinations left out with the reason.
struct SweepPlan {
  std::vector<Combo> runs;
  json skipped = json::array();
};

Options bench_cp_options() {
  Options opts("bench cp",
               "Sweeps context-parallel attention over sequence lengths, rank counts, strategies "
               "and layouts (threads transport), skipping invalid combinations with a note. "
               "Writes DIR/results.json and DIR/results.csv after every run (Ctrl-C keeps the "
               "finished rows) and draws DIR/*.png with scripts/plot_cp.py.");
  opts.add("seq", "4096,16384", "sequence lengths T (comma-separated; 64K, 1M allowed)")
      .add("ranks", "1,2,4,8", "rank counts P")
      .add("strategy", "ring,allgather,ulysses", "strategies: ring, allgather, ulysses, hybrid")
      .add("layout", "contiguous,zigzag,striped", "layouts: contiguous, zigzag, striped")
      .add("mask", "causal", "mask: none, causal, window:L,R, causal+window:L,R")
      .add("out", "cp-sweep", "output directory (created if missing)")
      .add_job_shape()
      .add("ulysses-degree", "0", "hybrid only: ranks per Ulysses group (0: all)")
      .add_device()
      .add("link-gbps", "0", "simulated link bandwidth in GB/s (0: none)")
      .add("link-latency-us", "0", "simulated link latency in microseconds")
      .flag("backward", "time the backward pass too")
      .flag("check", "check every run against the fp64 reference (slow for long sequences)")
      .flag("dry-run", "print the runs and skips, run nothing")
      .flag("no-plots", "write results.json and results.csv only")
      .add("python", "/usr/bin/python3", "Python with matplotlib, for the plots")
      .add("plot-script", "", "plot script (default: scripts/plot_cp.py of this source tree)")
      .example(
          "ctxpar bench cp --seq 4096,16384,65536 --ranks 1,2,4,8 --strategy "
          "ring,allgather,ulysses --layout contiguous,zigzag,striped --mask causal --out cp")
      .example("ctxpar bench cp --seq 2048 --ranks 4 --backward --link-gbps 25 --out slow-link");
  return opts;
}

Sweep sweep_from_options(const Options& opts) {
  Sweep w;
  w.seqs = parse_list(
      opts, "seq", [](const std::string& s) { return whole_number_in("seq", s, 1, kMaxTokens); });
  w.ranks = parse_list(opts, "ranks", [](const std::string& s) {
    return static_cast<int>(whole_number_in("ranks", s, 1, kMaxThreadsRanks, kThreadsRanksNote));
  });
  w.strategies =
      parse_list(opts, "strategy", [](const std::string& s) { return parse_strategy(s); });
  w.layouts = parse_list(opts, "layout", [](const std::string& s) { return parse_layout(s); });

  AttentionJob& base = w.base;
  try {
    base.mask = parse_mask(opts.str("mask"));
    base.dtype = parse_dtype(opts.str("dtype"));
    base.device = device_of(opts);
  } catch (const Error& e) {
    throw UsageError(e.what());
  }
  if (base.mask.documents)
    throw UsageError(
        "--mask documents is not swept (lengths depend on --seq); use ctxpar "
        "attention --mask documents:... for packed sequences");
  read_job_shape(opts, base);
  base.backward = opts.on("backward");
  base.check = opts.on("check");
  base.link.gbytes_per_second = opts.num_or_zero("link-gbps", kMinLinkGbps, kMaxLinkGbps);
  base.link.latency_us = opts.num("link-latency-us", 0, kMaxLinkLatencyUs);
  w.ulysses_degree = opts.i32("ulysses-degree", 0, kMaxThreadsRanks);
  memory_limit();  // a bad CTXPAR_MEMORY_LIMIT_BYTES: exit 2 now, not a skip of every run
  return w;
}

AttentionJob job_of(const Sweep& w, const Combo& c) {
  AttentionJob job = w.base;
  job.seq = c.seq, job.ranks = c.ranks, job.strategy = c.strategy, job.layout = c.layout;
  job.ulysses_degree = c.strategy == StrategyKind::hybrid ? w.ulysses_degree : 0;
  return job;
}

// Short sequences first, so an interrupted sweep has whole small sizes. At P = 1 every layout
// is the same run, so only the first layout listed runs there. Prints the skips (stderr).
SweepPlan plan_sweep(const Sweep& w) {
  SweepPlan plan;
  std::vector<std::string> notes;
  std::vector<int64_t> sorted_seqs = w.seqs;
  std::sort(sorted_seqs.begin(), sorted_seqs.end());
  std::vector<int> sorted_ranks = w.ranks;
  std::sort(sorted_ranks.begin(), sorted_ranks.end());
  bool p1_note = false;
  for (int64_t T : sorted_seqs)
    for (int P : sorted_ranks)
      for (StrategyKind s : w.strategies)
        for (size_t li = 0; li < w.layouts.size(); ++li) {
          Combo c{T, P, s, w.layouts[li]};
          if (P == 1 && li > 0) {
            p1_note = true;
            continue;
          }
          try {
            validate(job_of(w, c));
            plan.runs.push_back(c);
          } catch (const Error& e) {
            notes.push_back("skip " + c.name() + ": " + e.what());
            plan.skipped.push_back({{"seq", T},
                                    {"num_ranks", P},
                                    {"strategy", strategy_name(s)},
                                    {"layout", layout_name(c.layout)},
                                    {"reason", e.what()}});
          }
        }
  if (p1_note && w.layouts.size() > 1)
    notes.push_back(std::string("note: at P=1 every layout is the same run; running ") +
                    layout_name(w.layouts[0]) + " only");
  for (const auto& n : notes) std::fprintf(stderr, "%s\n", n.c_str());
  return plan;
}

// results.json's "sweep": what was asked for.
json sweep_record(const Options& opts, const Sweep& w) {
  const AttentionJob& base = w.base;
  json sweep = {{"seq", w.seqs},
                {"ranks", w.ranks},
                {"mask", opts.str("mask")},
                {"batch", base.batch},
                {"heads", base.heads},
                {"kv_heads", base.kv_heads},
                {"head_dim", base.head_dim},
                {"dtype", opts.str("dtype")},
                {"bf16_tier", bf16_tier_name(base.bf16_tier)},
                {"threads", base.threads},
                {"backward", base.backward},
                {"check", base.check},
                {"repeats", base.repeats},
                {"transport", "threads"}};
  std::vector<std::string> names;
  for (auto s : w.strategies) names.push_back(strategy_name(s));
  sweep["strategy"] = names;
  names.clear();
  for (auto l : w.layouts) names.push_back(layout_name(l));
  sweep["layout"] = names;
  return sweep;
}

// Runs the plan into `dir`, writing the results after every run; the table, the plots. The
// exit status: 130 interrupted, 1 a check failed, else 0.
int run_sweep(const Options& opts, const Sweep& w, SweepPlan plan, const fs::path& dir) {
  const json sweep = sweep_record(opts, w);
  json& skipped = plan.skipped;
  install_interrupt_handler();
  std::vector<json> rows;
  bool failed_check = false;
  write_results(dir, sweep, rows, skipped, false, false);
  {
    Progress bar("bench cp", static_cast<int64_t>(plan.runs.size()));
    // A run's cost grows as T^2 (attention) whatever P: the ETA weighs runs by it.
    auto work = [&](const Combo& c) {
      return static_cast<double>(c.seq) * static_cast<double>(c.seq);
    };
    double total_work = 0;
    for (const Combo& c : plan.runs) total_work += work(c);
    bar.set_work(total_work);
    for (const Combo& c : plan.runs) {
      if (interrupted()) break;
      bar.note(c.name());
      const AttentionJob job = job_of(w, c);
      try {
        AttentionResult result = run_attention_job(job);
        json row = to_json(job, result);
        if (result.checked && !result.check_passed) {
          failed_check = true;
          bar.print("check FAILED: " + c.name());
        }
        rows.push_back(std::move(row));
      } catch (const std::exception& e) {
        // One failed run (e.g. out of memory at the largest size) does not lose the sweep.
        bar.print("failed " + c.name() + ": " + e.what());
        skipped.push_back({{"seq", c.seq},
                           {"num_ranks", c.ranks},
                           {"strategy", strategy_name(c.strategy)},
                           {"layout", layout_name(c.layout)},
                           {"reason", std::string("failed: ") + e.what()}});
      }
      write_results(dir, sweep, rows, skipped, false, false);
      bar.advance_work(work(c));
    }
  }
  const bool stopped = interrupted();
  write_results(dir, sweep, rows, skipped, !stopped, stopped);
  if (stopped)
    std::fprintf(stderr, "bench cp: interrupted after %zu of %zu runs; kept in %s\n", rows.size(),
                 plan.runs.size(), dir.c_str());
  if (!rows.empty()) print_table(rows, w.base.backward);
  std::fflush(stdout);  // the table before the plot script's messages, also through a pipe
  std::fprintf(stderr, "wrote %s and %s\n", (dir / "results.json").c_str(),
               (dir / "results.csv").c_str());
  if (!rows.empty() && !opts.on("no-plots")) draw_plots(opts, dir);
  if (stopped) return 130;
  return failed_check ? 1 : 0;
}

}  // namespace

int bench_cp(int argc, char** argv) {
  Options opts = bench_cp_options();
  if (!opts.parse(argc, argv)) return 0;
  if (launched_by_mpi())
    throw UsageError(
        "bench cp sweeps P on the threads transport inside one process; run it "
        "without mpirun (for MPI timings: mpirun -n P ctxpar attention ...)");
  if (const ForeignLauncher l = foreign_launcher(); l.ranks > 0)
    throw UsageError("started by " + l.name + " as " + std::to_string(l.ranks) +
                     " processes, each of which would run the whole sweep: bench cp sweeps P on "
                     "the threads transport inside one process; run it once, without a launcher");

  const Sweep w = sweep_from_options(opts);
  SweepPlan plan = plan_sweep(w);
  if (plan.runs.empty())
    throw UsageError("no valid combination to run (every one was skipped, see above)");
  std::fprintf(stderr, "bench cp: %zu runs, %zu skipped\n", plan.runs.size(), plan.skipped.size());
  if (opts.on("dry-run")) {
    for (const Combo& c : plan.runs) std::printf("run %s\n", c.name().c_str());
    return 0;
  }
  const fs::path dir = opts.str("out");
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec || !fs::is_directory(dir))
    throw Error("--out " + dir.string() + ": cannot create the directory (" + ec.message() + ")");
  return run_sweep(opts, w, std::move(plan), dir);
}

}  // namespace ctxpar::cli
