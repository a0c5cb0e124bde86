// The MPI progress thread (src/comm/mpi_progress.cc, Note [MPI progress]), under mpirun in
// test_comm_mpi: a transfer must move while the ranks compute without calling MPI, and bad
// settings are errors naming the variable. The same overlap over a shaped TCP link, with
// timings, is the `net` test (tests/mpi/net_overlap_test.sh).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <thread>

#include "comm/mpi_progress.h"
#include "ctxpar/comm.h"

namespace ctxpar {
namespace {

using namespace std::chrono_literals;

// Pairs (0, 1), (2, 3), ...: the even rank sends 16 MB, then "computes" (sleeps, no MPI call)
// for 3.5 s. The odd rank checks its receive once every 100 ms for 2.5 s. Each check is one
// progress call on the receiving side; nothing on the sending side calls MPI in that time, so
// the message (a rendezvous: the sender must see the answer and write every fragment) can
// only arrive if the sender's progress thread moves it. Without the thread it does not
// (checked: the receive is still pending after 2.5 s).
TEST(MpiProgress, TransferMovesWhileRanksCompute) {
  Communicator& world = mpi_world();
  if (world.size() < 2) GTEST_SKIP() << "needs 2 ranks";
  auto comm = world.split(0, world.rank());
  const int r = comm->rank(), peer = r ^ 1;
  constexpr size_t kBytes = size_t(16) << 20;
  if (peer < comm->size()) {
    if (r % 2 == 0) {
      Buffer b = Buffer::uninitialized(kBytes);
      for (size_t i = 0; i < kBytes; ++i) b.data()[i] = std::byte(i * 7 + 1);
      Request send = comm->isend(std::move(b), peer, 5);
      std::this_thread::sleep_for(3500ms);  // computing: no MPI call on this thread
      send.wait();
    } else {
      Request recv = comm->irecv(kBytes, peer, 5);
      bool arrived = false;
      for (int i = 0; i < 25 && !arrived; ++i) {
        std::this_thread::sleep_for(100ms);
        arrived = recv.test();
      }
      EXPECT_TRUE(arrived) << "16 MB did not arrive in 2.5 s while the sender computed "
                              "without calling MPI: no progress thread moved it";
      Buffer got = recv.take();
      size_t wrong = 0;
      for (size_t i = 0; i < kBytes; ++i) wrong += got.data()[i] != std::byte(i * 7 + 1);
      EXPECT_EQ(wrong, 0u);
    }
  }
  world.barrier();
}

class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) { setenv(name, value, 1); }
  ~ScopedEnv() { unsetenv(name_); }

 private:
  const char* name_;
};

std::string settings_error() {
  try {
    comm_detail::progress_settings_from_env();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(MpiProgress, SettingsComeFromTheEnvironment) {
  EXPECT_TRUE(comm_detail::progress_settings_from_env().enabled);
  EXPECT_EQ(comm_detail::progress_settings_from_env().interval, 100us);
  {
    ScopedEnv off("CTXPAR_MPI_PROGRESS", "off");
    EXPECT_FALSE(comm_detail::progress_settings_from_env().enabled);
  }
  {
    ScopedEnv us("CTXPAR_MPI_PROGRESS_US", "250");
    EXPECT_EQ(comm_detail::progress_settings_from_env().interval, 250us);
  }
  {
    ScopedEnv bad("CTXPAR_MPI_PROGRESS", "async");
    EXPECT_EQ(settings_error(),
              "CTXPAR_MPI_PROGRESS must be 'thread' (a progress thread moves MPI transfers while "
              "the rank computes; the default) or 'off', got 'async'");
  }
  for (const char* v : {"0", "abc", "10ms", "200000"}) {
    ScopedEnv bad("CTXPAR_MPI_PROGRESS_US", v);
    EXPECT_EQ(settings_error(),
              std::string("CTXPAR_MPI_PROGRESS_US must be the progress thread's poll interval in "
                          "microseconds, 1..100000 (default 100), got '") + v + "'");
  }
}

}  // namespace
}  // namespace ctxpar

namespace ctxpar::testing {

// `test_comm_mpi --wrap-demo`: a program that owns MPI, as mpi4py does. It initialises MPI
// itself, wraps MPI_COMM_WORLD (mpi_wrap), moves a ring of 1 MB messages (which starts the
// progress thread) and finalises MPI itself: ctxpar's exit handler never runs, so the
// MPI_COMM_SELF attribute hook must stop the thread inside MPI_Finalize. The job must end,
// every rank printing "rank R: wrapped program finalised".
int progress_wrap_demo() {
  int provided = 0;
  MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided);
  int r = 0;
  {
    MPI_Comm world = MPI_COMM_WORLD;
    auto comm = mpi_wrap(&world);
    r = comm->rank();
    const int p = comm->size();
    Request recv = comm->irecv(size_t(1) << 20, (r + p - 1) % p, 1);
    Request send = comm->isend(Buffer(size_t(1) << 20), (r + 1) % p, 1);
    recv.take();
    send.wait();
    comm->barrier();
  }
  MPI_Finalize();
  std::printf("rank %d: wrapped program finalised\n", r);
  return 0;
}

}  // namespace ctxpar::testing
