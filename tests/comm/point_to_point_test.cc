// Every operation, counters included, on P in {1, 2, 3, 4, 8} threads, with and without a
// simulated link (deliveries then arrive late and in a different order: the answers must not
// change by a single bit).
#include <gtest/gtest.h>

#include <cstring>
#include <mutex>

#include "comm/comm_checks.h"

namespace ctxpar {
namespace {

class EveryOperation : public ::testing::TestWithParam<std::tuple<int, bool>> {};

TEST_P(EveryOperation, MatchesIndependentExpectations) {
  const auto [p, link] = GetParam();
  ThreadsOptions options;
  if (link) options.link = {/*gbytes_per_second=*/20, /*latency_us=*/30};
  options.timeout = std::chrono::seconds(20);
  run_threads(
      p, [](Communicator& comm) { testing::check_all(comm); }, options);
}

INSTANTIATE_TEST_SUITE_P(Threads, EveryOperation,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4, 8), ::testing::Bool()),
                         [](const auto& info) {
                           // Built with += : GCC 12 warns (falsely) on "P" + std::string.
                           std::string name = "P";
                           name += std::to_string(std::get<0>(info.param));
                           name += std::get<1>(info.param) ? "_link" : "_nolink";
                           return name;
                         });

// Same inputs: the same bits run after run, with or without a link (message arrival order
// differs between those runs).
TEST(Determinism, ReductionsAreBitwiseRepeatable) {
  for (int p : {3, 8}) {
    std::vector<std::vector<unsigned char>> first(p), again(p);
    std::mutex mu;
    auto collect = [&](std::vector<std::vector<unsigned char>>& into) {
      return [&](Communicator& comm) {
        auto bytes = testing::reduction_results(comm);
        std::lock_guard lock(mu);
        into[comm.rank()] = std::move(bytes);
      };
    };
    run_threads(p, collect(first));
    ThreadsOptions slow;
    slow.link = {5, 200};
    run_threads(p, collect(again), slow);
    for (int r = 0; r < p; ++r) {
      ASSERT_EQ(first[r].size(), again[r].size());
      EXPECT_EQ(std::memcmp(first[r].data(), again[r].data(), first[r].size()), 0)
          << "P=" << p << " rank " << r;
    }
  }
}

}  // namespace
}  // namespace ctxpar
