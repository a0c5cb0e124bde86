// `ctxpar bench cp`'s files: results.json and results.csv, rewritten after every run, and the
// plots scripts/plot_cp.py draws from them (bench_cp_files.cc). See docs/cli-files.md.
#pragma once
#include <filesystem>
#include <vector>

#include <nlohmann/json.hpp>

#include "options.h"

namespace ctxpar::cli {

// DIR/results.json ({sweep, runs, skipped, complete, interrupted}) and DIR/results.csv (one
// row per run, one column per figure), each written atomically.
void write_results(const std::filesystem::path& dir, const nlohmann::json& sweep,
                   const std::vector<nlohmann::json>& rows, const nlohmann::json& skipped,
                   bool complete, bool interrupted);

// DIR/*.png by scripts/plot_cp.py (--python, --plot-script); a failure is said on stderr and
// leaves the results in place.
void draw_plots(const Options& opts, const std::filesystem::path& dir);

}  // namespace ctxpar::cli
