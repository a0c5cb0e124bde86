// `ctxpar attention` refuses what cannot run with exit code 2 and a message that says what
// would work instead; it never crashes or starts ranks that would then hang.
#include <gtest/gtest.h>

#include <fstream>
#include <string>
#include <utility>

#include "cli/cli_support.h"
#include "ctxpar/mask.h"
#include "ctxpar/npy.h"

namespace ctxpar::test {
namespace {

struct Refusal {
  std::string args;
  std::vector<std::string> says;  // every part must appear in stderr
};

TEST(CliAttentionErrors, InvalidCombinationsExit2WithWhatWouldWork) {
  const Refusal cases[] = {
      {"--seq 64 --heads 6 --ranks 4 --strategy ulysses",
       {"--heads (6) divisible by 4", "--heads 8", "--strategy ring", "--ulysses-degree 2"}},
      {"--seq 64 --heads 8 --ranks 4 --strategy hybrid --ulysses-degree 3",
       {"--ulysses-degree 3 does not divide --ranks 4", "1, 2, 4"}},
      {"--seq 64 --ranks 2 --ulysses-degree 2", {"--strategy hybrid"}},
      {"--seq 64 --heads 4 --ranks 2 --strategy ulysses --exchange needed",
       {"--exchange needed applies to --strategy ring or allgather only", "--exchange auto"}},
      {"--seq 64 --ranks 2 --exchange sparse",
       {"unknown exchange 'sparse'", "auto, ring or needed"}},
      {"--seq 64 --heads 6 --kv-heads 4", {"multiple of --kv-heads", "--kv-heads 2"}},
      {"--seq 64 --head-dim 8", {"--head-dim must be in [16, 256]"}},
      {"--seq 64 --mask documents:30,30", {"add up to 60", "--seq is 64"}},
      {"--seq 64 --mask documents", {"documents:512,512", "--documents"}},
      {"--seq 64 --mask causl", {"unknown mask 'causl'", "causal"}},
      // Two INT64_MAX lengths + 514 wrapped to 512 and passed --seq 512, then failed
      // with vector::_M_fill_insert (exit 1); strtoll clamped out-of-range lengths silently;
      // any rule starting with "documents" was taken, a second one ignored.
      {"--seq 512 --mask documents:9223372036854775807,9223372036854775807,514",
       {"the lengths add up to more than 9223372036854775807", "--seq is 512"}},
      {"--seq 512 --mask documents:99999999999999999999",
       {"document length '99999999999999999999' is not a whole number in [1, 9223372036854775807]",
        "the grammar is"}},
      {"--seq 64 --mask documentsXYZ", {"unknown mask 'documentsXYZ'", "documents:LEN,LEN,..."}},
      {"--seq 64 --mask documents:32,32+documents:64", {"'documents' is given twice"}},
      {"--seq 64 --mask ' causal'", {"unknown mask ' causal'", "no spaces"}},
      {"--seq 64 --strategy rings", {"rings"}},
      {"--seq 64 --layout zigzig", {"zigzig"}},
      {"--seq 64 --transport mpi", {"mpirun -n 1", "--transport threads"}},
      {"--seq 64 --rank 2", {"unknown option --rank", "did you mean --ranks?"}},
      {"--seq 64 --dtype fp16", {"fp16"}},
      {"--seq many", {"--seq expects a whole number"}},
      {"--do x.npy", {"--do needs --q, --k and --v"}},
      {"--q /nonexistent/q.npy --k /nonexistent/k.npy --v /nonexistent/v.npy",
       {"/nonexistent/q.npy"}},
  };
  for (const Refusal& c : cases) {
    CommandResult r = run_ctxpar("attention " + c.args);
    EXPECT_EQ(r.exit_code, 2) << c.args << "\nstderr: " << r.err << "\nstdout: " << r.out;
    for (const auto& part : c.says)
      EXPECT_NE(r.err.find(part), std::string::npos)
          << c.args << ": stderr lacks '" << part << "':\n"
          << r.err;
    EXPECT_TRUE(r.out.empty()) << c.args << ": nothing on stdout on refusal, got " << r.out;
  }
}

// --transport is parsed once (transport_option): each command names the transports it takes.
TEST(CliAttentionErrors, UnknownTransportNamesTheOnesTheCommandTakes) {
  const std::pair<const char*, const char*> cases[] = {
      {"attention --seq 64 --transport tcp", "auto, threads, mpi, gloo, nccl or loopback"},
      {"train --seq 64 --steps 1 --transport nccl", "auto, threads, mpi or gloo"},
      {"decode --context 64 --tokens 1 --transport tcp", "auto, threads, mpi or gloo"}};
  for (const auto& [args, names] : cases) {
    const CommandResult r = run_ctxpar(args);
    EXPECT_EQ(r.exit_code, 2) << args << ": " << r.err;
    EXPECT_NE(r.err.find(std::string("--transport must be ") + names + ", got '"),
              std::string::npos)
        << args << ": " << r.err;
  }
}

// The library reads no environment: the command reads CTXPAR_ULYSSES_GROUPS into
// StrategyOptions::ulysses_groups, and a bad value is a usage error naming the variable,
// before any rank starts (attention and bench cp alike).
TEST(CliAttentionErrors, BadUlyssesGroupsVariableExitsTwo) {
  for (const std::string bad : {"0", "x", "2x", "-1", "5000"}) {
    for (const std::string& command :
         {std::string("attention --seq 64 --heads 4 --ranks 2 --strategy ulysses"),
          "bench cp --seq 64 --ranks 2 --strategy ulysses --dry-run --out " +
              temp_dir("uly_env")}) {
      CommandResult r =
          run_shell("CTXPAR_ULYSSES_GROUPS=" + bad + " " + ctxpar_path() + " " + command);
      EXPECT_EQ(r.exit_code, 2) << bad << ": " << command << "\n" << r.err << r.out;
      EXPECT_NE(r.err.find("CTXPAR_ULYSSES_GROUPS must be an integer in [1, 1024]"),
                std::string::npos)
          << r.err;
      EXPECT_NE(r.err.find("got '" + bad + "'"), std::string::npos) << r.err;
    }
  }
  // A good value runs (and gives the default's answer: it changes only the messages).
  CommandResult r = run_shell("CTXPAR_ULYSSES_GROUPS=2 " + ctxpar_path() +
                              " attention --seq 64 --heads 4 --ranks 2 --strategy ulysses --check");
  EXPECT_EQ(r.exit_code, 0) << r.err;
}

TEST(CliAttentionErrors, MalformedInputFileIsOneLineAndExit2) {
  const std::string dir = temp_dir("malformed");
  const std::string bad = dir + "/q.npy";
  std::ofstream(bad) << "this is not a numpy file";
  CommandResult r = run_ctxpar("attention --q " + bad + " --k " + bad + " --v " + bad);
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find(bad), std::string::npos) << r.err;
  EXPECT_EQ(r.err.find("ctxpar attention: error: "), 0u) << r.err;
  EXPECT_EQ(r.err.find('\n'), r.err.size() - 1) << "one line, got:\n" << r.err;
}

// INT64_MIN marks padding tokens (docs/layouts.md); a user position equal to it is refused
// rather than silently treated as padding.
TEST(CliAttentionErrors, PaddingPositionIsReserved) {
  const std::string dir = temp_dir("padpos");
  std::vector<int64_t> pos(16);
  for (int64_t i = 0; i < 16; ++i) pos[i] = i;
  pos[5] = kPaddingPosition;
  write_npy(dir + "/pos.npy", std::span<const int64_t>(pos));
  CommandResult r = run_ctxpar("attention --seq 16 --heads 2 --head-dim 16 --ranks 2 --positions " +
                               dir + "/pos.npy");
  EXPECT_EQ(r.exit_code, 2) << r.err;
  EXPECT_NE(r.err.find("token 5"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("marks padding"), std::string::npos) << r.err;
}

}  // namespace
}  // namespace ctxpar::test
