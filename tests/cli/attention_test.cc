// `ctxpar attention` end to end: small problems for every strategy and layout, checked by the
// command itself against the fp64 reference (its --check), with the per-rank JSON fields a
// user and `bench cp` rely on.
#include <gtest/gtest.h>

#include <string>

#include "cli/cli_support.h"

namespace ctxpar::test {
namespace {

CommandResult run_attention(const std::string& args) { return run_ctxpar("attention " + args); }

struct Case {
  std::string name, args;
  int ranks;
};

void expect_valid_run(const Case& c, const nlohmann::json& j) {
  SCOPED_TRACE(c.name + ": " + j.dump().substr(0, 4000));
  ASSERT_TRUE(j.contains("check_passed"));
  EXPECT_TRUE(j["check_passed"].get<bool>());
  EXPECT_LE(j["max_abs_err"].get<double>(), j["tolerance"].get<double>());
  EXPECT_GT(j["tolerance"].get<double>(), 0.0);
  ASSERT_EQ(j["ranks"].size(), static_cast<size_t>(c.ranks));
  int64_t tokens = 0;
  for (int r = 0; r < c.ranks; ++r) {
    const auto& k = j["ranks"][r];
    EXPECT_EQ(k["rank"].get<int>(), r);
    tokens += k["tokens"].get<int64_t>();
    EXPECT_GT(k["attention_flops"].get<double>(), 0.0);
    EXPECT_GT(k["busy_seconds"].get<double>(), 0.0);
    EXPECT_GT(k["peak_bytes"].get<double>(), 0.0);
    if (c.ranks > 1) {
      EXPECT_GT(k["bytes_sent"].get<double>(), 0.0);
      EXPECT_GT(k["bytes_received"].get<double>(), 0.0);
    }
  }
  EXPECT_EQ(tokens, j["seq"].get<int64_t>());
  EXPECT_GT(j["forward_seconds"].get<double>(), 0.0);
  if (j["backward"].get<bool>()) {
    EXPECT_GT(j["backward_seconds"].get<double>(), 0.0);
    EXPECT_EQ(j["check"]["quantities"].size(), 5u);  // out, lse, dq, dk, dv
  }
}

// Any --seq: 101 tokens divide by no layout's granule for P = 4; the command pads internally and
// its --check (against the fp64 reference of the unpadded 101 tokens) passes for every strategy
// x layout x mask, forward and backward; the ranks' real tokens add up to --seq.
TEST(CliAttention, AnySeqEveryStrategyLayoutMaskPassesItsCheck) {
  int runs = 0;
  for (const char* strategy : {"ring", "allgather", "ulysses", "hybrid --ulysses-degree 2"})
    for (const char* layout : {"contiguous", "zigzag", "striped"})
      for (const char* mask : {"none", "causal", "window:9,2", "causal+documents:30,50,21"}) {
        const Case c{std::string(strategy) + " " + layout + " " + mask,
                     std::string("--seq 101 --heads 4 --head-dim 16 --ranks 4 --backward --check "
                                 "--json --strategy ") +
                         strategy + " --layout " + layout + " --mask " + mask,
                     4};
        const CommandResult r = run_attention(c.args);
        ASSERT_EQ(r.exit_code, 0) << c.args << "\n" << r.err;
        expect_valid_run(c, parse_json(r));
        ++runs;
      }
  EXPECT_EQ(runs, 48);
}

TEST(CliAttention, EveryStrategyAndLayoutPassesItsCheck) {
  const std::string base = "--seq 96 --heads 4 --head-dim 32 --backward --check --json ";
  const Case cases[] = {
      {"single rank", base + "--mask causal --ranks 1", 1},
      {"ring contiguous", base + "--mask causal --ranks 3 --strategy ring", 3},
      {"ring zigzag", base + "--mask causal --ranks 4 --strategy ring --layout zigzag", 4},
      {"ring striped", base + "--mask causal --ranks 4 --strategy ring --layout striped", 4},
      {"allgather zigzag", base + "--mask causal --ranks 4 --strategy allgather --layout zigzag",
       4},
      {"ulysses striped", base + "--mask causal --ranks 4 --strategy ulysses --layout striped", 4},
      {"hybrid 2x2",
       base + "--mask causal --ranks 4 --strategy hybrid --ulysses-degree 2 "
              "--layout zigzag",
       4},
      {"ring window", base + "--mask window:20,3 --ranks 2 --layout zigzag", 2},
      {"ring documents", base + "--mask causal+documents:40,8,48 --ranks 4 --layout striped", 4},
      {"ring GQA bf16", base + "--kv-heads 1 --mask causal --ranks 2 --dtype bf16", 2},
      {"ulysses GQA no mask", base + "--kv-heads 2 --ranks 2 --strategy ulysses --batch 2", 2},
  };
  for (const Case& c : cases) {
    CommandResult r = run_attention(c.args);
    ASSERT_EQ(r.exit_code, 0) << c.name << "\nstderr: " << r.err << "\nstdout: " << r.out;
    expect_valid_run(c, parse_json(r));
  }
}

TEST(CliAttention, ZigzagBalancesCausalWork) {
  // Work is the FLOPs each rank computed (fully masked tiles skipped): contiguous causal puts
  // the whole triangle's bottom on the last rank, zigzag pairs early and late chunks.
  auto balance = [](const std::string& layout) {
    CommandResult r = run_attention(
        "--seq 4096 --heads 1 --head-dim 16 --mask causal --ranks 4 "
        "--json --layout " +
        layout);
    EXPECT_EQ(r.exit_code, 0) << r.err;
    return parse_json(r)["load_balance"].get<double>();
  };
  const double contiguous = balance("contiguous"), zigzag = balance("zigzag");
  EXPECT_GT(contiguous, 1.5);  // ideal 7/4 for P = 4
  EXPECT_LT(zigzag, 1.1);
}

TEST(CliAttention, HumanTableShowsRanksTotalsCheckAndMemory) {
  CommandResult r = run_attention(
      "--seq 128 --heads 2 --head-dim 16 --mask causal --ranks 2 "
      "--layout zigzag --backward --check");
  ASSERT_EQ(r.exit_code, 0) << r.err;
  for (const char* part : {"rank", "tokens", "total", "peak memory", "check: PASSED",
                           "one rank alone would need", "load balance"})
    EXPECT_NE(r.out.find(part), std::string::npos) << "missing '" << part << "' in\n" << r.out;
}

TEST(CliAttention, SampledCheckNamesItsRows) {
  // A tiny budget forces the sampled check: the JSON says which rows were compared.
  CommandResult r = run_attention(
      "--seq 512 --heads 2 --head-dim 16 --mask causal --ranks 2 "
      "--layout zigzag --backward --check --check-budget 1 --json");
  ASSERT_EQ(r.exit_code, 0) << r.err << r.out;
  nlohmann::json j = parse_json(r);
  EXPECT_TRUE(j["check"]["sampled"].get<bool>());
  const auto& rows = j["check"]["query_rows"];
  ASSERT_GE(rows.size(), 2u);
  EXPECT_EQ(rows.front().get<int>(), 0);
  EXPECT_EQ(rows.back().get<int>(), 511);
  EXPECT_FALSE(j["check"]["key_rows"].empty());
  EXPECT_TRUE(j["check_passed"].get<bool>());
}

TEST(CliAttention, HelpListsEveryOptionWithDefaults) {
  CommandResult r = run_ctxpar("attention --help");
  ASSERT_EQ(r.exit_code, 0);
  for (const char* opt : {"--seq",       "--heads",
                          "--kv-heads",  "--head-dim",
                          "--batch",     "--mask",
                          "--dtype",     "--threads",
                          "--backward",  "--check",
                          "--json",      "--seed",
                          "--repeats",   "--ranks",
                          "--strategy",  "--ulysses-degree",
                          "--layout",    "--transport",
                          "--link-gbps", "--link-latency-us",
                          "--timeout",   "--q",
                          "--k",         "--v",
                          "--do",        "--out",
                          "--layout-in", "--documents",
                          "--positions", "(default: 4096)",
                          "examples:"})
    EXPECT_NE(r.out.find(opt), std::string::npos) << "help lacks " << opt;
}

}  // namespace
}  // namespace ctxpar::test
