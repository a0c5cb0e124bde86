// The library's cross-rank agreement (ctxpar/agreement.h): one allgather of a fixed-size verdict
// when the ranks agree, the first differing field named (in the library's words) when not, the
// ranks whose own arguments were bad named first. The strategies, the command and the Python
// package all refuse through it (tests/strategy/frame_test.cc, tests/cli, tests/python).
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "ctxpar/agreement.h"
#include "ctxpar/comm.h"
#include "ctxpar/error.h"

namespace ctxpar {
namespace {

// Each rank's error text ("" when require_agreement returned).
std::vector<std::string> refusals(int p, const std::function<Signature(int)>& signature_of,
                                  const std::function<std::string(int)>& error_of) {
  std::vector<std::string> errors(p);
  run_threads(p, [&](Communicator& comm) {
    try {
      require_agreement(comm, "call", signature_of(comm.rank()), error_of(comm.rank()));
    } catch (const Error& e) {
      errors[comm.rank()] = e.what();
    }
  });
  return errors;
}

std::string no_error(int) { return ""; }

TEST(Agreement, SameSignaturesCostOneAllgather) {
  run_threads(4, [&](Communicator& comm) {
    const CommCounters c0 = comm.counters();
    const Agreement a = agree_across_ranks(comm, {{"mask", "causal"}, {"seq", "4096"}});
    EXPECT_TRUE(a.agreed());
    EXPECT_EQ(comm.counters().calls_of(CommKind::allgather) - c0.calls_of(CommKind::allgather), 1u);
  });
}

TEST(Agreement, TheFirstDifferingFieldIsNamedOnEveryRank) {
  const auto errors = refusals(
      4,
      [](int r) {
        return Signature{{"strategy", "ring"},
                         {"mask window", r == 3 ? "64" : "128"},
                         {"seq", r == 2 ? "1024" : "4096"}};
      },
      no_error);
  for (const std::string& e : errors)
    EXPECT_EQ(e,
              "call: the ranks were called with different arguments: mask window is 128 on "
              "rank 0 but 64 on rank 3; every rank of the communicator must pass the same");
}

TEST(Agreement, AFieldOneRankLacksOrLeavesEmptyIsNamed) {
  const auto errors = refusals(
      2,
      [](int r) {
        return r == 0 ? Signature{{"out", "given"}} : Signature{{"out", ""}, {"extra", "1"}};
      },
      no_error);
  EXPECT_EQ(errors[1],
            "call: the ranks were called with different arguments: out is given on "
            "rank 0 but (not given) on rank 1; every rank of the communicator must "
            "pass the same");
  const auto extra = refusals(
      2,
      [](int r) {
        return r == 0 ? Signature{} : Signature{{"extra", "1"}};
      },
      no_error);
  EXPECT_NE(extra[0].find("extra is (unknown to this rank) on rank 0 but 1 on rank 1"),
            std::string::npos)
      << extra[0];
}

TEST(Agreement, LocalErrorsComeFirstNamingEveryFailedRank) {
  const auto errors = refusals(
      4,
      [](int r) {
        return Signature{{"seq", std::to_string(r)}};
      },
      [](int r) { return r == 1 || r == 3 ? "lse: bad shape on rank " + std::to_string(r) : ""; });
  for (const std::string& e : errors)
    EXPECT_EQ(e, "call: invalid arguments on rank 1, 3 (of 4): lse: bad shape on rank 1");
}

}  // namespace
}  // namespace ctxpar
