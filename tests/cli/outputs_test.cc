// What the command writes and where (help, --json with stderr merged,
// the --out folder given as a link, its mode, hidden folders of killed runs, environment
// variables, the fault hooks of the test build).
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

// Every command's and subcommand's --help prints its help on stdout and exits 0.
TEST(CliOutputs, EveryHelpExits0) {
  for (const char* command : {"attention", "train", "plan", "bench", "bench kernel", "bench cp"}) {
    SCOPED_TRACE(command);
    const CommandResult r = run_ctxpar(std::string(command) + " --help");
    EXPECT_EQ(r.exit_code, 0) << r.err;
    EXPECT_NE(r.out.find("usage"), std::string::npos) << r.out;
  }
  const CommandResult r = run_ctxpar("bench --help");
  EXPECT_NE(r.out.find("kernel"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("cp"), std::string::npos) << r.out;
}

// bench kernel times after --warmup untimed calls (default 1, as bench/torch_sdpa.py warms
// torch up), and says how many in its JSON and its text.
TEST(CliOutputs, BenchKernelSaysItsWarmup) {
  const std::string small = "bench kernel --seq 64 --heads 1 --head-dim 16 --repeats 1 ";
  for (const int warmup : {-1, 0, 2}) {
    SCOPED_TRACE(warmup);
    const std::string given = warmup < 0 ? "" : "--warmup " + std::to_string(warmup) + " ";
    const CommandResult j = run_ctxpar(small + given + "--json");
    ASSERT_EQ(j.exit_code, 0) << j.err;
    const nlohmann::json out = nlohmann::json::parse(j.out);
    EXPECT_EQ(out["warmup"], warmup < 0 ? 1 : warmup);
    EXPECT_GT(out["fwd_gflops"].get<double>(), 0.0);
    const CommandResult t = run_ctxpar(small + given);
    ASSERT_EQ(t.exit_code, 0) << t.err;
    const std::string says = "after " + std::to_string(warmup < 0 ? 1 : warmup) + " warm-up call";
    EXPECT_NE(t.out.find(says), std::string::npos) << t.out;
  }
}

// bench kernel --peak-only measures the FMA peak alone (bench/cpu_suite.sh's figure beside each
// torch run): the peak in its JSON and its text, and no kernel timed.
TEST(CliOutputs, BenchKernelPeakOnlyTimesNoKernel) {
  const CommandResult j = run_ctxpar("bench kernel --peak-only --threads 1 --repeats 1 --json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const nlohmann::json out = nlohmann::json::parse(j.out);
  EXPECT_GT(out["peak_gflops"].get<double>(), 0.0);
  EXPECT_GT(out["peak_gflops_cpu"].get<double>(), 0.0);
  EXPECT_EQ(out["threads"], 1);
  EXPECT_FALSE(out.contains("fwd_gflops")) << j.out;
  const CommandResult t = run_ctxpar("bench kernel --peak-only --threads 1 --repeats 1");
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("FMA peak, 1 thread(s)"), std::string::npos) << t.out;
  EXPECT_EQ(t.out.find("forward"), std::string::npos) << t.out;
}

// --memory bhtd lays every tensor out as [B, H, T, D] storage under the kernel's [B, T, H, D]
// views (torch's own layout, bench/torch_sdpa.py's default) and says so; anything else is refused.
TEST(CliOutputs, BenchKernelMemoryLayouts) {
  for (const char* memory : {"bthd", "bhtd"}) {
    const CommandResult r = run_ctxpar(std::string("bench kernel --seq 200 --heads 3 --kv-heads 1 "
                                                   "--head-dim 32 --repeats 1 --warmup 0 --json "
                                                   "--memory ") +
                                       memory);
    ASSERT_EQ(r.exit_code, 0) << r.err;
    const nlohmann::json out = nlohmann::json::parse(r.out);
    EXPECT_EQ(out["memory"], memory);
    for (const char* f : {"fwd_gflops", "bwd_gflops", "causal_fwd_gflops", "causal_bwd_gflops"})
      EXPECT_GT(out[f].get<double>(), 0.0) << memory << " " << f;
  }
  const CommandResult text = run_ctxpar(
      "bench kernel --seq 64 --heads 1 --head-dim 16 --repeats 1 --no-backward --memory bhtd");
  ASSERT_EQ(text.exit_code, 0) << text.err;
  EXPECT_NE(text.out.find("fp32 on [B, H, T, D] memory"), std::string::npos) << text.out;
  const CommandResult bad = run_ctxpar("bench kernel --memory bhdt --repeats 1");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("--memory bhdt: expected bthd or bhtd"), std::string::npos) << bad.err;
}

// Progress is drawn only on a terminal (or with --progress): `--json 2>&1` is one JSON object,
// also for a problem big enough that progress lines used to go to a log.
TEST(CliOutputs, JsonWithStderrMergedIsJson) {
  // 16384^2 x 16 x 5 repeats = 2.1e10: above the size that drew plain lines into logs.
  const CommandResult r =
      run_shell(ctxpar_path() +
                " attention --seq 16384 --heads 1 "
                "--head-dim 16 --mask causal --ranks 1 --repeats 5 --json 2>&1");
  ASSERT_EQ(r.exit_code, 0) << r.out;
  EXPECT_TRUE(nlohmann::json::accept(r.out)) << r.out.substr(0, 300);
  // --progress asks for the lines anyway (stderr).
  const CommandResult p = run_ctxpar(kSmallAttention + "--json --progress");
  ASSERT_EQ(p.exit_code, 0) << p.err;
  EXPECT_NE(p.err.find("attention: "), std::string::npos) << p.err;
  EXPECT_TRUE(nlohmann::json::accept(p.out)) << p.out;
}

// --out given as a link to a folder: the results reach the link's target, the link stays.
TEST(CliOutputs, OutThroughALinkReachesItsTarget) {
  const std::string dir = temp_dir("out_link");
  fs::create_directories(dir + "/target");
  fs::create_directory_symlink("target", dir + "/link");
  const CommandResult r = run_ctxpar(kSmallAttention + "--out " + dir + "/link");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::is_symlink(dir + "/link")) << "the link was replaced by a folder";
  EXPECT_TRUE(fs::exists(dir + "/target/out.npy"));
  // Again, into the previous output through the link.
  ASSERT_EQ(run_ctxpar(kSmallAttention + "--seed 4 --out " + dir + "/link").exit_code, 0);
  EXPECT_TRUE(fs::is_symlink(dir + "/link"));
  EXPECT_TRUE(fs::exists(dir + "/target/lse.npy"));
  // A link to nothing is refused by name, before the run.
  fs::create_directory_symlink("nowhere", dir + "/dangling");
  const CommandResult d = run_ctxpar(kSmallAttention + "--out " + dir + "/dangling");
  EXPECT_EQ(d.exit_code, 2) << d.err;
  EXPECT_NE(d.err.find("--out " + dir + "/dangling is a symbolic link to no folder"),
            std::string::npos)
      << d.err;
  fs::remove_all(dir);
}

// The results folder gets the mode the umask gives any new folder (it was 0700 always).
TEST(CliOutputs, OutFolderHonoursTheUmask) {
  const std::string dir = temp_dir("out_umask");
  for (const auto& [mask, mode] : {std::pair{"022", 0755}, std::pair{"077", 0700}}) {
    SCOPED_TRACE(mask);
    const std::string out = dir + "/res" + mask;
    ASSERT_EQ(run_shell(std::string("umask ") + mask + "; " + ctxpar_path() + " " +
                        kSmallAttention + "--out " + out)
                  .exit_code,
              0);
    struct stat st = {};
    ASSERT_EQ(::stat(out.c_str(), &st), 0);
    EXPECT_EQ(st.st_mode & 0777, mode);
  }
  fs::remove_all(dir);
}

// A run killed while writing leaves its hidden folder; the next run for the same --out
// removes it (ours by name, its pid dead), and nothing else.
TEST(CliOutputs, HiddenFoldersOfKilledRunsAreRemoved) {
  const std::string dir = temp_dir("out_stale"), out = dir + "/res";
  CommandResult r = run_shell("CTXPAR_OUT_FAULT=before-swap " + fault_ctxpar_path() + " " +
                              kSmallAttention + "--out " + out);
  ASSERT_EQ(r.exit_code, 128 + 9) << r.err;
  auto hidden = [&] {
    int n = 0;
    for (const auto& e : fs::directory_iterator(dir))
      n += e.path().filename().string().rfind(".res.ctxpar-new.", 0) == 0;
    return n;
  };
  ASSERT_EQ(hidden(), 1) << "the killed run left no hidden folder to clean";
  // Not stale: a running process's (this test's own pid, this host).
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const std::string live =
      dir + "/.res.ctxpar-new." + std::to_string(getpid()) + "-" + host + ".abcdef";
  fs::create_directories(live);
  fs::create_directories(dir + "/.other.ctxpar-new.1-" + host + ".abcdef");  // another --out's
  r = run_ctxpar(kSmallAttention + "--out " + out);
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(hidden(), 1) << "the killed run's folder is still there";
  EXPECT_TRUE(fs::exists(live));
  EXPECT_TRUE(fs::exists(dir + "/.other.ctxpar-new.1-" + host + ".abcdef"));
  fs::remove_all(dir);
}

// The fault hooks are compiled into the test build (ctxpar-faults) only: the release binary
// ignores them.
TEST(CliOutputs, ReleaseBinaryHasNoFaultHooks) {
  const std::string dir = temp_dir("no_hooks");
  CommandResult r = run_shell("CTXPAR_FAULT_RANK=0 CTXPAR_OUT_FAULT=before-swap " + ctxpar_path() +
                              " " + kSmallAttention + "--ranks 2 --out " + dir + "/res");
  EXPECT_EQ(r.exit_code, 0) << r.err;
  EXPECT_TRUE(fs::exists(dir + "/res/out.npy"));
  r = run_shell("CTXPAR_FAULT_RANK=0 " + fault_ctxpar_path() + " " + kSmallAttention + "--ranks 2");
  EXPECT_EQ(r.exit_code, 1) << r.err;  // the test build does fail on purpose
  fs::remove_all(dir);
}

// A bad CTXPAR_* variable is a usage error: exit 2 naming it, before anything runs (not a
// rank's failure, exit 1).
TEST(CliOutputs, BadEnvironmentVariableExits2) {
  const std::pair<const char*, const char*> bad[] = {
      {"CTXPAR_SIMD=bogus", "CTXPAR_SIMD=bogus"},
      {"CTXPAR_BF16_PRODUCTS=bogus", "CTXPAR_BF16_PRODUCTS=bogus: expected on, off or auto"},
      {"CTXPAR_FP32_PRODUCTS=bogus", "CTXPAR_FP32_PRODUCTS=bogus: expected fma"},
      {"CTXPAR_ULYSSES_GROUPS=0", "CTXPAR_ULYSSES_GROUPS must be an integer in [1, 1024]"},
      {"CTXPAR_MEMORY_LIMIT_BYTES=abc", "CTXPAR_MEMORY_LIMIT_BYTES must be"},
#ifdef CTXPAR_HAVE_MPI
      {"CTXPAR_MPI_INIT_TIMEOUT=inf", "CTXPAR_MPI_INIT_TIMEOUT must be"},
      {"CTXPAR_MPI_PROGRESS=bogus", "CTXPAR_MPI_PROGRESS must be"},
      {"CTXPAR_MPI_PROGRESS_US=0", "CTXPAR_MPI_PROGRESS_US must be"},
#endif
  };
  for (const auto& [env, message] : bad) {
    SCOPED_TRACE(env);
    const CommandResult r = run_shell(std::string(env) + " " + ctxpar_path() + " " +
                                      kSmallAttention + "--strategy ulysses --ranks 2");
    EXPECT_EQ(r.exit_code, 2) << r.err;
    EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  }
}

// CTXPAR_FP32_PRODUCTS=parts under a SIMD target below avx512 (and, on a CPU without AMX-BF16,
// under any: the same opening) exits 2 naming it, before anything runs. Asking simd_targets()
// for the target's name while it was being made once hung here. The sanitizer build compiles no
// target below avx512 (only avx512_dl and scalar, which ignores the setting).
TEST(CliOutputs, Fp32PartsRefusedBelowAvx512Exits2) {
  const CommandResult v = run_ctxpar("--version");
  ASSERT_EQ(v.exit_code, 0) << v.err;
  const size_t at = v.out.find("SIMD targets compiled in:");
  ASSERT_NE(at, std::string::npos) << v.out;
  const std::string compiled = v.out.substr(at, v.out.find('\n', at) - at);
  std::string below;
  for (const char* t : {"avx2", "sse4", "ssse3"})
    if (below.empty() && compiled.find(t) != std::string::npos) below = t;
  if (below.empty())
    GTEST_SKIP() << "this build compiles no SIMD target below avx512: " << compiled;
  const CommandResult r =
      run_shell("CTXPAR_SIMD=" + below + " CTXPAR_FP32_PRODUCTS=parts " + ctxpar_path() + " " +
                kSmallAttention + "--strategy ring --ranks 2");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("CTXPAR_FP32_PRODUCTS=parts: KernelConfig::fp32_products = parts needs"),
            std::string::npos)
      << r.err;
}

// ctxpar plan --documents: per layout, the balance of the packed-documents mask and the K/V a
// rank receives by ring and by the needed exchange (figures checked in tests/layout), as a table
// and as JSON; bad lengths exit 2 naming the option.
TEST(CliOutputs, PlanDocumentsComparesLayouts) {
  const std::string args = "plan --seq 16K --cp 4 --documents lognormal:1000,1.5,1 ";
  const CommandResult t = run_ctxpar(args);
  ASSERT_EQ(t.exit_code, 0) << t.err;
  EXPECT_NE(t.out.find("needed/ring"), std::string::npos) << t.out;
  const CommandResult j = run_ctxpar(args + "--json");
  ASSERT_EQ(j.exit_code, 0) << j.err;
  const nlohmann::json d = parse_json(j)["documents"];
  int64_t sum = 0;
  for (int64_t l : d["lengths"]) sum += l;
  EXPECT_EQ(sum, 16384);
  const nlohmann::json& l = d["layouts"];
  for (const char* name : {"contiguous", "zigzag", "striped", "balanced"}) {
    ASSERT_TRUE(l.contains(name)) << name;
    EXPECT_LE(l[name]["needed_bytes_received"].get<double>(),
              l[name]["ring_bytes_received"].get<double>())
        << name;
  }
  EXPECT_LE(l["balanced"]["busiest_over_mean_work"].get<double>(), 1.05);
  EXPECT_LT(l["balanced"]["busiest_over_mean_work"].get<double>(),
            l["zigzag"]["busiest_over_mean_work"].get<double>());
  for (const auto& [bad, what] : std::vector<std::pair<std::string, std::string>>{
           {"1000,2000", "add up to 3000 but --seq is 16384"},
           {"0,16384", "--documents: mask 'documents:0,16384': document length '0'"},
           {"lognormal:1,2", "lognormal:MEDIAN,SIGMA,SEED expects"}}) {
    const CommandResult r = run_ctxpar("plan --seq 16K --cp 4 --documents " + bad);
    EXPECT_EQ(r.exit_code, 2) << bad << ": " << r.err;
    EXPECT_NE(r.err.find(what), std::string::npos) << r.err;
  }
}

}  // namespace
}  // namespace ctxpar::test
