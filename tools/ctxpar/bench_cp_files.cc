// `ctxpar bench cp`'s files (bench_cp_files.h).
#include "bench_cp_files.h"

#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <set>
#include <string>

#include "ctxpar/npy.h"

extern char** environ;

namespace ctxpar::cli {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

// ---- results.json / results.csv ----------------------------------------------------------

// One CSV column per figure: objects and arrays of objects flatten to dotted names
// ("ranks.3.peak_bytes"); an array of plain values stays one cell, space-separated.
void flatten(const json& j, const std::string& prefix,
             std::vector<std::pair<std::string, std::string>>& out) {
  auto cell = [](const json& v) -> std::string {
    if (v.is_string()) return v.get<std::string>();
    if (v.is_null()) return "";
    return v.dump();
  };
  if (j.is_object()) {
    for (auto it = j.begin(); it != j.end(); ++it)
      flatten(it.value(), prefix.empty() ? it.key() : prefix + '.' + it.key(), out);
  } else if (j.is_array() &&
             std::any_of(j.begin(), j.end(), [](const json& v) { return v.is_structured(); })) {
    for (size_t i = 0; i < j.size(); ++i) flatten(j[i], prefix + '.' + std::to_string(i), out);
  } else if (j.is_array()) {
    std::string s;
    for (const auto& v : j) {
      if (!s.empty()) s += ' ';
      s += cell(v);
    }
    out.emplace_back(prefix, s);
  } else {
    out.emplace_back(prefix, cell(j));
  }
}

std::string csv_field(const std::string& s) {
  if (s.find_first_of(",\"\n\r") == std::string::npos) return s;
  std::string q = "\"";
  for (char c : s) q += c == '"' ? std::string("\"\"") : std::string(1, c);
  return q + "\"";
}

std::string to_csv(const std::vector<json>& rows) {
  std::vector<std::vector<std::pair<std::string, std::string>>> flat(rows.size());
  for (size_t i = 0; i < rows.size(); ++i) flatten(rows[i], "", flat[i]);
  // Columns: what identifies a run first, then the union of every row's figures; the row with
  // the most ranks sets the order, so ranks.0..ranks.P-1 come out in rank order.
  std::vector<std::string> columns = {"seq", "num_ranks", "strategy", "layout", "mask"};
  std::set<std::string> seen(columns.begin(), columns.end());
  std::vector<size_t> order(rows.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return flat[a].size() > flat[b].size(); });
  for (size_t i : order)
    for (const auto& [k, v] : flat[i])
      if (seen.insert(k).second) columns.push_back(k);
  // The run's own figures before the per-rank ones (ranks.0.tokens, ...).
  std::stable_partition(columns.begin(), columns.end(),
                        [](const std::string& c) { return c.find('.') == std::string::npos; });
  std::string out;
  for (size_t c = 0; c < columns.size(); ++c) {
    if (c) out += ',';
    out += csv_field(columns[c]);
  }
  out += "\n";
  for (const auto& row : flat) {
    for (size_t c = 0; c < columns.size(); ++c) {
      if (c) out += ",";
      for (const auto& [k, v] : row)
        if (k == columns[c]) {
          out += csv_field(v);
          break;
        }
    }
    out += "\n";
  }
  return out;
}

// ---- plots ------------------------------------------------------------------------------

// scripts/plot_cp.py: --plot-script, $CTXPAR_PLOT_SCRIPT, the source tree this binary was
// built from, or beside the binary (build dir inside the source tree, or an install prefix).
std::string find_plot_script(const std::string& given) {
  if (!given.empty()) return given;
  if (const char* env = std::getenv("CTXPAR_PLOT_SCRIPT")) return env;
  std::vector<fs::path> candidates = {fs::path(__FILE__).parent_path() /
                                      "../../scripts/plot_cp.py"};
  std::error_code ec;
  fs::path exe = fs::read_symlink("/proc/self/exe", ec);
  if (!ec) {
    candidates.push_back(exe.parent_path() / "../scripts/plot_cp.py");
    candidates.push_back(exe.parent_path() / "../share/ctxpar/plot_cp.py");
  }
  for (const auto& c : candidates)
    if (fs::exists(c, ec)) return fs::weakly_canonical(c, ec).string();
  return "";
}

// Runs `python -I script results.json --out dir` with its output on our stderr; returns its exit
// status (127: python could not be started).
int run_plot_script(const std::string& python, const std::string& script, const fs::path& dir) {
  std::string results = (dir / "results.json").string(), out = dir.string();
  // -I (isolated): neither the working folder, the script's folder, PYTHONPATH nor the user's
  // site-packages is searched, so a json.py planted beside the results is never imported.
  std::vector<char*> argv = {const_cast<char*>(python.c_str()),
                             const_cast<char*>("-I"),
                             const_cast<char*>(script.c_str()),
                             results.data(),
                             const_cast<char*>("--out"),
                             out.data(),
                             nullptr};
  posix_spawn_file_actions_t fa;
  posix_spawn_file_actions_init(&fa);
  posix_spawn_file_actions_adddup2(&fa, STDERR_FILENO, STDOUT_FILENO);  // keep stdout for the table
  pid_t pid;
  int rc = posix_spawn(&pid, python.c_str(), &fa, nullptr, argv.data(), environ);
  posix_spawn_file_actions_destroy(&fa);
  if (rc != 0) return 127;
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {}
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

}  // namespace

void write_results(const fs::path& dir, const json& sweep, const std::vector<json>& rows,
                   const json& skipped, bool complete, bool interrupted) {
  json j;
  j["sweep"] = sweep;
  j["runs"] = rows;
  j["skipped"] = skipped;
  j["complete"] = complete;
  j["interrupted"] = interrupted;
  write_file_atomic((dir / "results.json").string(), j.dump(1) + "\n");
  write_file_atomic((dir / "results.csv").string(), to_csv(rows));
}

void draw_plots(const Options& opts, const fs::path& dir) {
  const std::string python = opts.str("python");
  const std::string script = find_plot_script(opts.str("plot-script"));
  if (script.empty()) {
    std::fprintf(stderr,
                 "plots skipped: scripts/plot_cp.py not found (give --plot-script PATH); "
                 "results.json and results.csv are written\n");
    return;
  }
  if (access(python.c_str(), X_OK) != 0) {
    std::fprintf(stderr,
                 "plots skipped: %s not found (apt-get install python3-matplotlib); "
                 "results.json and results.csv are written\n",
                 python.c_str());
    return;
  }
  const int rc = run_plot_script(python, script, dir);
  if (rc == 3)  // plot_cp.py's code for "matplotlib is missing"
    std::fprintf(stderr,
                 "plots skipped: %s has no matplotlib (apt-get install "
                 "python3-matplotlib); results.json and results.csv are written\n",
                 python.c_str());
  else if (rc != 0)
    std::fprintf(stderr,
                 "plots failed: %s %s exited with %d; results.json and results.csv are "
                 "written\n",
                 python.c_str(), script.c_str(), rc);
}

}  // namespace ctxpar::cli
