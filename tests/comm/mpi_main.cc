// The communicator checks on the MPI transport: run as `mpirun -n P test_comm_mpi` (see
// CMakeLists.txt: P = 2 and 4). Every rank runs the same gtest cases on mpi_world(); rank 0
// prints. `--wrap-demo`: a program that owns MPI, finalising it itself (mpi_progress_cases.cc).
// `test_comm_mpi --abort-demo` instead shows run_mpi ending the whole job when one
// rank throws (the test passes when the message appears and the job ends in time).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <mutex>
#include <string>

#include "comm/comm_checks.h"
#include "ctxpar/comm.h"

namespace ctxpar {
namespace {

using std::chrono::milliseconds;

std::string message_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Mpi, IsLaunchedAsExpected) {
  Communicator& world = mpi_world();
  EXPECT_TRUE(launched_by_mpi());
  EXPECT_EQ(world.transport(), TransportKind::mpi);
  EXPECT_GE(world.size(), 1);
}

TEST(Mpi, EveryOperationMatchesIndependentExpectations) { testing::check_all(mpi_world()); }

// The threads transport with the same P must give the same bits.
TEST(Mpi, ReductionsAreBitwiseEqualToThreads) {
  Communicator& world = mpi_world();
  const auto on_mpi = testing::reduction_results(world);
  std::vector<unsigned char> on_threads;
  std::mutex mu;
  run_threads(world.size(), [&](Communicator& comm) {
    auto bytes = testing::reduction_results(comm);
    std::lock_guard lock(mu);
    if (comm.rank() == world.rank()) on_threads = std::move(bytes);
  });
  ASSERT_EQ(on_mpi.size(), on_threads.size());
  EXPECT_EQ(std::memcmp(on_mpi.data(), on_threads.data(), on_mpi.size()), 0);
}

TEST(Mpi, WaitTimesOutNamingRankPeerAndTag) {
  Communicator& world = mpi_world();
  if (world.size() < 2) GTEST_SKIP();
  auto comm = world.split(0, world.rank());  // a throwaway group for the failed exchange
  comm->set_timeout(milliseconds(300));
  const auto t0 = std::chrono::steady_clock::now();
  if (comm->rank() == 0) {
    EXPECT_EQ(message_of([&] { comm->irecv(8, 1, 77).wait(); }),
              "rank 0: timed out after 0.3 s waiting for recv from rank 1 (tag 77)");
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  }
  world.barrier();
}

TEST(Mpi, ReceiveOfWrongSizeNamesTheSizes) {
  Communicator& world = mpi_world();
  if (world.size() < 2) GTEST_SKIP();
  auto comm = world.split(0, world.rank());
  comm->set_timeout(milliseconds(5000));
  if (comm->rank() == 0) {
    comm->isend(Buffer(8), 1, 3).wait();
    comm->isend(Buffer(8), 1, 4).wait();
  } else if (comm->rank() == 1) {
    EXPECT_EQ(message_of([&] { comm->irecv(16, 0, 3).wait(); }),
              "rank 1: recv from rank 0 (tag 3) expected 16 bytes, but the message has 8 bytes");
    EXPECT_EQ(message_of([&] { comm->irecv(4, 0, 4).wait(); }),
              "rank 1: recv from rank 0 (tag 4) expected 4 bytes, but the message has more "
              "than 4 bytes");
  }
  world.barrier();
}

TEST(Mpi, CollectiveSkippedByOneRankFails) {
  Communicator& world = mpi_world();
  if (world.size() < 2) GTEST_SKIP();
  auto comm = world.split(0, world.rank());
  comm->set_timeout(milliseconds(400));
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = message_of([&] {
    float x[8] = {}, y = 1;
    if (comm->rank() != 1) comm->allgather(&y, x, sizeof(float));
    comm->barrier();
  });
  // Ranks that see the other collective's message say so; the others time out.
  EXPECT_TRUE(msg.find("timed out after 0.4 s") != std::string::npos ||
              msg.find("collective mismatch") != std::string::npos)
      << msg;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  world.set_timeout(std::chrono::seconds(30));
  world.barrier();
}

TEST(Mpi, InvalidArgumentsAreErrors) {
  Communicator& world = mpi_world();
  EXPECT_THROW(world.isend(Buffer(4), world.size(), 0), Error);
  EXPECT_THROW(world.irecv(4, -1, 0), Error);
  EXPECT_THROW(world.isend(Buffer(4), 0, -1), Error);
}

// Ranks other than 0 print only their failures, prefixed with the rank.
class FailurePrinter : public ::testing::EmptyTestEventListener {
 public:
  explicit FailurePrinter(int rank) : rank_(rank) {}
  void OnTestPartResult(const ::testing::TestPartResult& result) override {
    if (!result.failed()) return;
    std::fprintf(stderr, "[rank %d] %s:%d: Failure\n%s\n", rank_,
                 result.file_name() ? result.file_name() : "?", result.line_number(),
                 result.summary());
  }

 private:
  int rank_;
};

}  // namespace
}  // namespace ctxpar

namespace ctxpar::testing {
int progress_wrap_demo();
}

int main(int argc, char** argv) {
  if (argc > 1 && std::string(argv[1]) == "--wrap-demo")
    return ctxpar::testing::progress_wrap_demo();
  if (argc > 1 && std::string(argv[1]) == "--abort-demo") {
    ctxpar::run_mpi([](ctxpar::Communicator& comm) {
      comm.set_timeout(std::chrono::seconds(100));  // MPI_Abort, not a timeout, must end it
      if (comm.rank() == 1) throw ctxpar::Error("deliberate failure");
      comm.barrier();
    });
    return 0;
  }
  ::testing::InitGoogleTest(&argc, argv);
  ctxpar::Communicator& world = ctxpar::mpi_world();
  if (world.rank() != 0) {
    auto& listeners = ::testing::UnitTest::GetInstance()->listeners();
    delete listeners.Release(listeners.default_result_printer());
    listeners.Append(new ctxpar::FailurePrinter(world.rank()));
  }
  return RUN_ALL_TESTS();
}
