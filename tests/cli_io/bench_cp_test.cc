// `ctxpar bench cp` driven as a user would: the built binary in a child process, its files
// checked by an independent reader (Python's json / csv, matplotlib's PNG reader).
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fcntl.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

extern char** environ;

namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string ctxpar_binary() {
  const char* dir = std::getenv("CTXPAR_BUILD_DIR");
  return std::string(dir ? dir : ".") + "/ctxpar";
}

std::string slurp(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool have_matplotlib() {
  static const bool ok =
      std::system("/usr/bin/python3 -c 'import matplotlib, numpy' >/dev/null 2>&1") == 0;
  return ok;
}

class BenchCp : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() /
           ("ctxpar_bench_cp_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(dir_);
    fs::create_directories(dir_);
    ASSERT_TRUE(fs::exists(ctxpar_binary())) << ctxpar_binary() << " is not built";
  }
  void TearDown() override { fs::remove_all(dir_); }

  // Starts `ctxpar bench cp ARGS --out DIR/out` with stdout and stderr to files.
  pid_t start(std::vector<std::string> args) {
    std::vector<std::string> full = {ctxpar_binary(), "bench", "cp"};
    full.insert(full.end(), args.begin(), args.end());
    full.push_back("--out");
    full.push_back(out().string());
    std::vector<char*> argv;
    for (auto& a : full) argv.push_back(a.data());
    argv.push_back(nullptr);
    posix_spawn_file_actions_t fa;
    posix_spawn_file_actions_init(&fa);
    posix_spawn_file_actions_addopen(&fa, 1, (dir_ / "stdout").c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    posix_spawn_file_actions_addopen(&fa, 2, (dir_ / "stderr").c_str(),
                                     O_WRONLY | O_CREAT | O_TRUNC, 0644);
    pid_t pid = -1;
    EXPECT_EQ(posix_spawn(&pid, argv[0], &fa, nullptr, argv.data(), environ), 0);
    posix_spawn_file_actions_destroy(&fa);
    return pid;
  }
  int wait(pid_t pid) {
    int status = 0;
    waitpid(pid, &status, 0);
    out_text_ = slurp(dir_ / "stdout");
    err_text_ = slurp(dir_ / "stderr");
    // Killed by a signal reads as 1000 + signal, never as an exit code (130 != killed by SIGINT).
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
  }
  int run(std::vector<std::string> args) { return wait(start(std::move(args))); }
  int python(const std::string& body) {
    std::ofstream(dir_ / "check.py")
        << "import json, csv, sys, os\nD = '" << out().string() << "'\n"
        << body;
    return std::system(("/usr/bin/python3 " + (dir_ / "check.py").string()).c_str());
  }
  fs::path out() const { return dir_ / "out"; }

  fs::path dir_;
  std::string out_text_, err_text_;
};

// The runs a sweep over these lists must make: every strategy x layout for P > 1, one layout
// per strategy at P = 1 (all layouts are the same run there).
TEST_F(BenchCp, TinySweepWritesEveryRowAndTheFourPlots) {
  const int rc = run({"--seq", "128,256", "--ranks", "1,2,4", "--strategy",
                      "ring,allgather,ulysses", "--layout", "contiguous,zigzag,striped", "--heads",
                      "4", "--head-dim", "16", "--mask", "causal"});
  ASSERT_EQ(rc, 0) << err_text_;
  const int expected_runs = 2 * (3 + 2 * 9);
  json results = json::parse(slurp(out() / "results.json"));
  ASSERT_EQ(results["runs"].size(), static_cast<size_t>(expected_runs));
  EXPECT_TRUE(results["complete"].get<bool>());
  EXPECT_FALSE(results["interrupted"].get<bool>());
  EXPECT_TRUE(results["skipped"].empty()) << results["skipped"].dump();
  for (const json& r : results["runs"]) {
    // Each row is one run of the asked shape: P rank reports whose tokens cover T.
    ASSERT_EQ(r["ranks"].size(), r["num_ranks"].get<size_t>());
    int64_t tokens = 0;
    for (const json& rk : r["ranks"]) tokens += rk["tokens"].get<int64_t>();
    EXPECT_EQ(tokens, r["seq"].get<int64_t>());
    EXPECT_EQ(r["heads"].get<int>(), 4);
    EXPECT_EQ(r["head_dim"].get<int>(), 16);
  }
  // Not a TTY here: plain progress lines, no carriage returns, the final one complete.
  EXPECT_NE(
      err_text_.find(std::to_string(expected_runs) + "/" + std::to_string(expected_runs) + " 100%"),
      std::string::npos)
      << err_text_;
  EXPECT_EQ(err_text_.find('\r'), std::string::npos);
  // The table on stdout: a row per run.
  EXPECT_NE(out_text_.find("GFLOP/s"), std::string::npos) << out_text_;

  if (!have_matplotlib()) GTEST_SKIP() << "/usr/bin/python3 with matplotlib is not installed";
  for (const char* png : {"throughput.png", "memory.png", "work.png", "time_split.png"}) {
    SCOPED_TRACE(png);
    ASSERT_TRUE(fs::exists(out() / png)) << err_text_;
    EXPECT_GT(fs::file_size(out() / png), 10000u);
  }
  // Python's csv reader against Python's json reader: the CSV holds every figure of every run.
  EXPECT_EQ(python(R"(
import matplotlib.image as mpimg
runs = json.load(open(D + '/results.json'))['runs']
rows = list(csv.DictReader(open(D + '/results.csv', newline='')))
assert len(rows) == len(runs), (len(rows), len(runs))
def flat(j, prefix, out):
    if isinstance(j, dict):
        for k, v in j.items(): flat(v, prefix + '.' + k if prefix else k, out)
    elif isinstance(j, list) and any(isinstance(v, (dict, list)) for v in j):
        for i, v in enumerate(j): flat(v, '%s.%d' % (prefix, i), out)
    elif isinstance(j, list):
        out[prefix] = ' '.join(json.dumps(v) if not isinstance(v, str) else v for v in j)
    else:
        out[prefix] = j
for run, row in zip(runs, rows):
    f = {}
    flat(run, '', f)
    assert set(f) <= set(row), sorted(set(f) - set(row))
    for k, v in f.items():
        if isinstance(v, bool):
            assert row[k] == ('true' if v else 'false'), (k, v, row[k])
        elif isinstance(v, (int, float)):
            assert float(row[k]) == float(v), (k, v, row[k])
        else:
            assert row[k] == str(v), (k, v, row[k])
for png in ['throughput.png', 'memory.png', 'work.png', 'time_split.png']:
    img = mpimg.imread(D + '/' + png)
    assert img.shape[0] >= 300 and img.shape[1] >= 400, (png, img.shape)
    assert img.std() > 0.05, png + ' looks blank'
)"),
            0);
}

TEST_F(BenchCp, InvalidCombinationsAreSkippedWithANote) {
  // T = 20, P = 4: ulysses needs the 2 heads divisible by 4 (zigzag pads T to 24 and runs).
  const std::vector<std::string> args = {
      "--seq",        "20",       "--ranks",           "4",       "--strategy",
      "ring,ulysses", "--layout", "contiguous,zigzag", "--heads", "2",
      "--head-dim",   "16",       "--no-plots"};
  std::vector<std::string> dry = args;
  dry.push_back("--dry-run");
  ASSERT_EQ(run(dry), 0) << err_text_;
  EXPECT_EQ(err_text_.find("skip T=20 P=4 ring/zigzag"), std::string::npos) << err_text_;
  EXPECT_NE(out_text_.find("run T=20 P=4 ring/zigzag"), std::string::npos) << out_text_;
  EXPECT_NE(err_text_.find("skip T=20 P=4 ulysses/contiguous: "), std::string::npos) << err_text_;
  EXPECT_NE(err_text_.find("skip T=20 P=4 ulysses/zigzag: "), std::string::npos) << err_text_;
  EXPECT_NE(out_text_.find("run T=20 P=4 ring/contiguous"), std::string::npos) << out_text_;
  EXPECT_FALSE(fs::exists(out() / "results.json")) << "a dry run writes nothing";

  ASSERT_EQ(run(args), 0) << err_text_;
  json results = json::parse(slurp(out() / "results.json"));
  ASSERT_EQ(results["runs"].size(), 2u);
  EXPECT_EQ(results["runs"][0]["layout"], "contiguous");
  EXPECT_EQ(results["runs"][1]["layout"], "zigzag");
  ASSERT_EQ(results["skipped"].size(), 2u);
  for (const json& s : results["skipped"]) EXPECT_FALSE(s["reason"].get<std::string>().empty());
}

TEST_F(BenchCp, OptionErrorsExit2WithAPointerToHelp) {
  const std::vector<std::vector<std::string>> bad = {
      {"--sq", "128"},           // unknown option (did you mean --seq?)
      {"--strategy", "rign"},    // unknown strategy
      {"--layout", "diagonal"},  // unknown layout
      {"--seq", "12x"},          // not a number
      {"--seq", ""},             // empty list
      {"--ranks", "0"},          // out of range
      {"--mask", "sideways"},    // unknown mask
      {"--dtype", "f64"},        // unknown dtype
      {"--heads", "many"},       // not a number
      {"--seq", "8", "--ranks", "2", "--heads", "3", "--strategy", "ulysses"},  // nothing valid
      {"--mask", "documents:4,4"},                                              // not sweepable
      {"--backward=maybe"},  // a flag with a value
      {"stray"},             // not an option
  };
  for (const auto& args : bad) {
    std::vector<std::string> a = args;
    a.push_back("--dry-run");
    std::string shown;
    for (const auto& s : args) shown += s + " ";
    SCOPED_TRACE(shown);
    EXPECT_EQ(run(a), 2) << err_text_;
    EXPECT_NE(err_text_.find("--help"), std::string::npos) << err_text_;
  }
  EXPECT_EQ(run({"--help"}), 0);
  for (const char* opt :
       {"--seq", "--ranks", "--strategy", "--layout", "--mask", "--out", "--heads", "--head-dim",
        "--dtype", "--threads", "--backward", "--repeats", "(default: 4096,16384)", "examples:"})
    EXPECT_NE(out_text_.find(opt), std::string::npos) << opt;
}

// The plot script runs isolated (python -I): a json.py on PYTHONPATH (or in the working
// folder) is never imported in place of the standard module.
TEST_F(BenchCp, PlotScriptRunsIsolated) {
  const fs::path planted = dir_ / "planted";
  fs::create_directories(planted);
  std::ofstream(planted / "json.py")
      << "open(" << json((dir_ / "PWNED").string()).dump() << ", 'w')\n";
  ::setenv("PYTHONPATH", planted.c_str(), 1);
  const int rc = run({"--seq", "64", "--ranks", "2", "--strategy", "ring", "--layout", "zigzag",
                      "--heads", "2", "--head-dim", "16"});
  ::unsetenv("PYTHONPATH");
  EXPECT_EQ(rc, 0) << err_text_;
  EXPECT_FALSE(fs::exists(dir_ / "PWNED")) << "the plot script imported a planted json.py";
  EXPECT_TRUE(fs::exists(out() / "results.json"));
}

TEST_F(BenchCp, WithoutPythonTheResultsAreStillWritten) {
  ASSERT_EQ(run({"--seq", "64", "--ranks", "2", "--strategy", "ring", "--layout", "zigzag",
                 "--heads", "2", "--head-dim", "16", "--python", "/nonexistent/python3"}),
            0)
      << err_text_;
  EXPECT_NE(err_text_.find("plots skipped: /nonexistent/python3 not found"), std::string::npos)
      << err_text_;
  EXPECT_TRUE(fs::exists(out() / "results.json"));
  EXPECT_TRUE(fs::exists(out() / "results.csv"));
  EXPECT_FALSE(fs::exists(out() / "throughput.png"));
}

TEST_F(BenchCp, WithoutMatplotlibTheResultsAreStillWritten) {
  if (std::system("/usr/bin/python3 -c 'import sys' >/dev/null 2>&1") != 0)
    GTEST_SKIP() << "/usr/bin/python3 is not installed";
  // A Python on which `import matplotlib` fails, whatever is installed (it takes -I, isolated
  // mode, as ctxpar passes it).
  const fs::path fake = dir_ / "python-without-matplotlib";
  std::ofstream(fake) << "#!/bin/sh\n[ \"$1\" = -I ] && shift\n"
                         "exec /usr/bin/python3 -I -c \"import sys; sys.modules['matplotlib'] = "
                         "None; sys.argv = sys.argv[1:]; exec(open(sys.argv[0]).read())\" \"$@\"\n";
  fs::permissions(fake, fs::perms::owner_all);
  ASSERT_EQ(run({"--seq", "64", "--ranks", "2", "--strategy", "ring", "--layout", "zigzag",
                 "--heads", "2", "--head-dim", "16", "--python", fake.string()}),
            0)
      << err_text_;
  EXPECT_NE(err_text_.find("has no matplotlib"), std::string::npos) << err_text_;
  EXPECT_TRUE(fs::exists(out() / "results.json"));
  EXPECT_TRUE(fs::exists(out() / "results.csv"));
  EXPECT_FALSE(fs::exists(out() / "throughput.png"));
}

TEST_F(BenchCp, CtrlCStopsAfterTheCurrentRunAndKeepsFinishedRows) {
  const pid_t pid = start({"--seq", "512,1024,1536,2048,2560,3072", "--ranks", "2,4", "--strategy",
                           "ring,allgather", "--layout", "contiguous,zigzag,striped", "--heads",
                           "2", "--head-dim", "32", "--no-plots"});
  const size_t total = 6 * 2 * 2 * 3;
  // Wait for the first finished row, then press Ctrl-C.
  size_t seen = 0;
  for (int i = 0; i < 3000 && seen == 0; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    std::string text = slurp(out() / "results.json");
    if (!text.empty()) seen = json::parse(text)["runs"].size();  // written atomically: whole
  }
  ASSERT_GT(seen, 0u) << "no row finished in 30 s";
  kill(pid, SIGINT);
  const int rc = wait(pid);
  EXPECT_EQ(rc, 130) << err_text_;
  EXPECT_NE(err_text_.find("interrupted"), std::string::npos) << err_text_;
  json results = json::parse(slurp(out() / "results.json"));
  const size_t kept = results["runs"].size();
  EXPECT_GE(kept, seen);
  EXPECT_LT(kept, total) << "the sweep ran to the end instead of stopping";
  EXPECT_TRUE(results["interrupted"].get<bool>());
  EXPECT_FALSE(results["complete"].get<bool>());
  // The CSV holds the same rows: a header and one line per kept run.
  std::string csv = slurp(out() / "results.csv");
  EXPECT_EQ(static_cast<size_t>(std::count(csv.begin(), csv.end(), '\n')), kept + 1);
  for (const auto& e : fs::directory_iterator(out()))
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
}

TEST_F(BenchCp, PlotScriptRejectsABadResultsFile) {
  if (!have_matplotlib()) GTEST_SKIP() << "/usr/bin/python3 with matplotlib is not installed";
  fs::create_directories(out());
  std::ofstream(out() / "results.json") << "{ not json";
  const char* src = std::getenv("CTXPAR_SOURCE_DIR");
  ASSERT_NE(src, nullptr);
  const std::string cmd = "/usr/bin/python3 " + std::string(src) + "/scripts/plot_cp.py " +
                          (out() / "results.json").string() + " 2>/dev/null";
  const int status = std::system(cmd.c_str());
  EXPECT_EQ(WEXITSTATUS(status), 2);
}

}  // namespace
