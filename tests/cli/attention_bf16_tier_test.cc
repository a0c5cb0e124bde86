// Round three: the fast bf16 tier (KernelConfig::bf16_tier = fast: P and dS rounded to bf16, as
// GPU flash attention does; docs/kernel.md, "bf16 tiers") reachable from `ctxpar attention
// --bf16-tier exact|fast`, on every rank of every transport (StrategyOptions::kernel, which the
// ranks agree on), checked by the command against fp64 under the fast tier's own rule.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <string>

#include "cli/cli_support.h"
#include "ctxpar/npy.h"

namespace ctxpar::test {
namespace {

namespace fs = std::filesystem;

const std::string kBf16Problem =
    "--seq 256 --heads 4 --kv-heads 2 --head-dim 64 --mask causal "
    "--backward ";
const char* const kOutputs[] = {"out.npy", "lse.npy", "dq.npy", "dk.npy", "dv.npy"};

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() &&
         std::memcmp(a.data(), b.data(), a.bytes()) == 0;
}

// Which of the --out files of two runs differ (bitwise), e.g. "dq dk dv".
std::string differing_outputs(const std::string& a, const std::string& b) {
  std::string names;
  for (const char* f : kOutputs)
    if (!same_bytes(read_npy(a + "/" + f), read_npy(b + "/" + f)))
      names += std::string(names.empty() ? "" : " ") + f;
  return names;
}

// `args` --out dir --json: exits 0 and reports its tier.
nlohmann::json run_into(const std::string& args, const std::string& dir, const char* tier) {
  const CommandResult r = run_ctxpar("attention " + args + " --out " + dir + " --json");
  EXPECT_EQ(r.exit_code, 0) << args << "\n" << r.err << r.out.substr(0, 2000);
  nlohmann::json j = parse_json(r);
  EXPECT_EQ(j["bf16_tier"], tier) << args;
  return j;
}

TEST(CliBf16Tier, BogusTierExits2NamingTheOptionAndBothChoices) {
  for (const char* command : {"attention --seq 64 --heads 2 --head-dim 16",
                              "bench kernel --seq 64 --heads 1 --head-dim 16 --repeats 1"}) {
    SCOPED_TRACE(command);
    const CommandResult r = run_ctxpar(std::string(command) + " --dtype bf16 --bf16-tier bogus");
    EXPECT_EQ(r.exit_code, 2) << r.err << r.out;
    EXPECT_NE(r.err.find("--bf16-tier bogus: expected exact or fast"), std::string::npos) << r.err;
  }
  const CommandResult help = run_ctxpar("attention --help");
  EXPECT_NE(help.out.find("--bf16-tier"), std::string::npos) << help.out;
  EXPECT_NE(help.out.find("with fp32 inputs the tier changes nothing"), std::string::npos);
}

// bf16 inputs: the fast tier passes --check (its floor 2^-7 for out, as for the gradients) for
// each strategy, and its gradients differ from the exact tier's -- the tier reached the kernel
// of every rank. The exact tier given explicitly is the default, bitwise.
TEST(CliBf16Tier, FastTierPassesItsCheckAndDiffersFromExact) {
  for (const char* strategy : {"ring", "ulysses", "allgather"}) {
    SCOPED_TRACE(strategy);
    const std::string args = kBf16Problem + "--dtype bf16 --ranks 2 --check --strategy " + strategy;
    const std::string dir = temp_dir(std::string("tier_") + strategy);
    const nlohmann::json fast = run_into(args + " --bf16-tier fast", dir + "/fast", "fast");
    EXPECT_TRUE(fast["check_passed"].get<bool>()) << fast["check"].dump();
    for (const auto& q : fast["check"]["quantities"])
      if (q["name"] == "out" || q["name"] == "dq" || q["name"] == "dk" || q["name"] == "dv") {
        EXPECT_GE(q["tolerance"].get<double>(), 0x1.0p-7) << q.dump();  // the fast tier's floor
      }
    run_into(args + " --bf16-tier exact", dir + "/exact", "exact");
    run_into(args, dir + "/default", "exact");
    const std::string differ = differing_outputs(dir + "/fast", dir + "/exact");
    EXPECT_NE(differ.find("dq.npy"), std::string::npos) << differ;
    EXPECT_NE(differ.find("dk.npy"), std::string::npos) << differ;
    EXPECT_NE(differ.find("dv.npy"), std::string::npos) << differ;
    EXPECT_EQ(differing_outputs(dir + "/exact", dir + "/default"), "");
    fs::remove_all(dir);
  }
}

// fp32 inputs: the tier changes nothing, bitwise.
TEST(CliBf16Tier, Fp32InputsIgnoreTheTier) {
  const std::string args = kBf16Problem + "--ranks 2 --strategy ring";
  const std::string dir = temp_dir("tier_fp32");
  run_into(args + " --bf16-tier fast", dir + "/fast", "fast");
  run_into(args + " --bf16-tier exact", dir + "/exact", "exact");
  EXPECT_EQ(differing_outputs(dir + "/fast", dir + "/exact"), "");
  fs::remove_all(dir);
}

// Under mpirun (the cli_mpi entry): the fast tier travels to every process -- the answer is the
// threads transport's, bitwise. (Ranks given different tiers are refused, naming --bf16-tier:
// CliMpi.RanksWithDifferentOptionsAreRefusedNamingTheOption.)
class CliMpiBf16Tier : public MpiCommandTest {};

TEST_F(CliMpiBf16Tier, FastTierOverMpiIsTheThreadsAnswer) {
  const std::string args = kBf16Problem + "--dtype bf16 --ranks 2";
  const std::string dir = temp_dir("tier_mpi");
  run_into(args + " --transport threads --bf16-tier fast", dir + "/threads", "fast");
  run_into(args + " --transport threads --bf16-tier exact", dir + "/exact", "exact");
  const std::string line =
      ctxpar_path() + " attention " + args + " --bf16-tier fast --out " + dir + "/mpi";
  const CommandResult r = run_shell(mpirun("-n 2 " + line));
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  EXPECT_EQ(differing_outputs(dir + "/mpi", dir + "/threads"), "");
  EXPECT_NE(differing_outputs(dir + "/mpi", dir + "/exact"), "");

  fs::remove_all(dir);
}

}  // namespace
}  // namespace ctxpar::test
