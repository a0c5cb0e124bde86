// --device: the simulated asynchronous device writes the same bytes as the cpu device, for
// every strategy (the command a user runs to check a strategy change on sim), and the command
// refuses what it cannot do with a usage error.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

std::string bytes_of(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), {});
}

TEST(CliDevice, SimWritesTheCpuBytesForEveryStrategy) {
  for (const std::string s : {"ring", "allgather", "ulysses", "hybrid --ulysses-degree 2"}) {
    const std::string name = s.substr(0, s.find(' '));
    const std::string a = temp_dir("device_cpu_" + name), b = temp_dir("device_sim_" + name);
    const std::string args =
        "attention --seq 4096 --heads 8 --kv-heads 2 --head-dim 64 --ranks 4 "
        "--strategy " +
        s + " --layout zigzag --mask causal --backward";
    const CommandResult cpu = run_ctxpar(args + " --device cpu --out " + a);
    ASSERT_EQ(cpu.exit_code, 0) << cpu.err;
    const CommandResult sim = run_ctxpar(args + " --device sim --sim-seed 3 --out " + b);
    ASSERT_EQ(sim.exit_code, 0) << sim.err;
    int files = 0;
    for (const auto& e : std::filesystem::directory_iterator(a)) {
      if (e.path().extension() != ".npy") continue;
      ++files;
      const std::filesystem::path other = std::filesystem::path(b) / e.path().filename();
      ASSERT_TRUE(std::filesystem::exists(other)) << other;
      EXPECT_TRUE(bytes_of(e.path()) == bytes_of(other)) << s << ": " << e.path().filename();
    }
    EXPECT_GE(files, 5) << s << ": out, lse, dq, dk, dv";
  }
}

TEST(CliDevice, JsonSaysTheDevice) {
  const CommandResult r =
      run_ctxpar("attention --seq 256 --heads 2 --head-dim 16 --ranks 2 --device sim --json");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  EXPECT_EQ(parse_json(r)["device"], "sim");
}

TEST(CliDevice, UnknownDeviceIsAUsageError) {
  const CommandResult r = run_ctxpar("attention --seq 256 --heads 2 --head-dim 16 --device gpu");
  EXPECT_EQ(r.exit_code, 2);
  EXPECT_NE(r.err.find("unknown device 'gpu': use cpu, sim or cuda"), std::string::npos) << r.err;
}

// The library's Ulysses rule (Hq % P == 0; KV heads replicated when they do not split) is the
// command's rule: 6 query heads over 3 ranks with 2 KV heads runs.
TEST(CliDevice, UlyssesHeadsFollowTheLibrarysRule) {
  const CommandResult ok = run_ctxpar(
      "attention --heads 6 --kv-heads 2 --ranks 3 --strategy "
      "ulysses --layout contiguous --seq 3072 --head-dim 16");
  EXPECT_EQ(ok.exit_code, 0) << ok.err;
  const CommandResult bad = run_ctxpar(
      "attention --heads 6 --kv-heads 2 --ranks 4 --strategy "
      "ulysses --seq 256 --head-dim 16");
  EXPECT_EQ(bad.exit_code, 2);
  EXPECT_NE(bad.err.find("needs --heads (6) divisible by 4"), std::string::npos) << bad.err;
}

}  // namespace
}  // namespace ctxpar::test
