// MPI progress (src/comm/mpi_progress.cc, Note [MPI progress]), under mpirun in
// test_comm_mpi: a transfer must move while the ranks compute without calling MPI (sleeping:
// the progress thread's case; running the CPU kernel: the thread's and the tile hook's), and
// bad settings are errors naming the variable. CMakeLists.txt runs the binary with
// CTXPAR_MPI_PROGRESS=thread and =tiles (the default). The same overlap over a shaped TCP link, with
// timings, is the `net` test (tests/mpi/net_overlap_test.sh).
#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>
#include <string>
#include <thread>

#include "comm/mpi_progress.h"
#include "ctxpar/comm.h"
#include "ctxpar/kernel.h"

namespace ctxpar {
namespace {

using namespace std::chrono_literals;

// Pairs (0, 1), (2, 3), ...: the even rank sends 16 MB, then "computes" (`compute` until a
// time point: no MPI call on its thread) for 3.5 s. The odd rank computes the same way in
// slices of 100 ms and checks its receive after each, for 2.5 s. Each check is one progress
// call on the receiving side; nothing on the sending side calls MPI in that time, so the
// message (a rendezvous: the sender must see the answer and write every fragment) can only
// arrive if the sender's progress thread or tile hook moves it. Without them it does not
// (checked, CTXPAR_MPI_PROGRESS=off: the receive is still pending after 2.5 s).
void check_transfer_moves_while(
    const std::function<void(std::chrono::steady_clock::time_point)>& compute, const char* what) {
  Communicator& world = mpi_world();
  auto comm = world.split(0, world.rank());
  const int r = comm->rank(), peer = r ^ 1;
  constexpr size_t kBytes = size_t(16) << 20;
  if (peer < comm->size()) {
    if (r % 2 == 0) {
      Buffer b = Buffer::uninitialized(kBytes);
      for (size_t i = 0; i < kBytes; ++i) b.data()[i] = std::byte(i * 7 + 1);
      Request send = comm->isend(std::move(b), peer, 5);
      compute(std::chrono::steady_clock::now() + 3500ms);  // no MPI call on this thread
      send.wait();
    } else {
      Request recv = comm->irecv(kBytes, peer, 5);
      bool arrived = false;
      for (int i = 0; i < 25 && !arrived; ++i) {
        compute(std::chrono::steady_clock::now() + 100ms);
        arrived = recv.test();
      }
      EXPECT_TRUE(arrived) << "16 MB did not arrive in 2.5 s while the sender " << what
                           << " without calling MPI: no progress thread or tile hook moved it ("
                           << comm_detail::mpi_progress().describe() << ")";
      Buffer got = recv.take();
      size_t wrong = 0;
      for (size_t i = 0; i < kBytes; ++i) wrong += got.data()[i] != std::byte(i * 7 + 1);
      EXPECT_EQ(wrong, 0u);
    }
  }
  world.barrier();
}

TEST(MpiProgress, TransferMovesWhileRanksCompute) {
  if (mpi_world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto s = comm_detail::progress_settings_from_env();
  if (!s.thread && s.tiles)
    GTEST_SKIP() << "CTXPAR_MPI_PROGRESS=tiles: no thread, and a sleeping rank runs no kernel";
  check_transfer_moves_while([](auto until) { std::this_thread::sleep_until(until); }, "slept");
}

// The same while both ranks run the CPU kernel (forward blocks of 1024 x 1024 tokens, 4 heads
// of 64, one thread: 1k tiles a call), as the ranks of a ring step do. In
// CTXPAR_MPI_PROGRESS=tiles mode no progress thread runs (asserted), so the kernel's tile hook
// alone must move the transfer. (The receiver computes too: with tiles, a receiver that sleeps
// progresses only in its tests, 10 a second, too few to drain 16 MB of fragments.)
TEST(MpiProgress, TransferMovesWhileTheKernelComputes) {
  if (mpi_world().size() < 2) GTEST_SKIP() << "needs 2 ranks";
  const auto s = comm_detail::progress_settings_from_env();
  const int64_t n = 1024, heads = 4, d = 64;
  Tensor q(DType::f32, {1, n, heads, d}), kv(DType::f32, {1, n, heads, d});
  for (Tensor* t : {&q, &kv})
    for (int64_t i = 0; i < t->numel(); ++i)
      t->ptr<float>()[i] = static_cast<float>((i * 37) % 101) / 101.0f - 0.5f;
  std::vector<int64_t> pos(n);
  for (int64_t i = 0; i < n; ++i) pos[i] = i;
  const Tokens tokens{pos, {}};
  check_transfer_moves_while(
      [&](auto until) {
        if (s.tiles && !s.thread) {
          EXPECT_FALSE(comm_detail::mpi_progress().thread_running());
          EXPECT_TRUE(comm_detail::mpi_progress().tiles_armed());
        }
        ForwardState state(1, n, heads, d);
        int64_t calls = 0;
        while (std::chrono::steady_clock::now() < until || calls == 0) {
          attention_forward_block(q, tokens, kv, kv, tokens, Mask::none(), state);
          ++calls;
        }
      },
      "ran the CPU kernel");
}

// Sets a variable for a scope and restores what it was (the binary also runs under
// CTXPAR_MPI_PROGRESS=tiles, which the cases above read).
class ScopedEnv {
 public:
  ScopedEnv(const char* name, const char* value) : name_(name) {
    if (const char* old = std::getenv(name)) old_ = old, had_ = true;
    setenv(name, value, 1);
  }
  ~ScopedEnv() {
    if (had_)
      setenv(name_, old_.c_str(), 1);
    else
      unsetenv(name_);
  }

 private:
  const char* name_;
  std::string old_;
  bool had_ = false;
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
  {
    ScopedEnv unset("CTXPAR_MPI_PROGRESS", "");  // as unset: the default
    EXPECT_FALSE(comm_detail::progress_settings_from_env().thread);
    EXPECT_TRUE(comm_detail::progress_settings_from_env().tiles);
    EXPECT_EQ(comm_detail::progress_settings_from_env().interval, 100us);
  }
  for (auto [mode, thread, tiles] : {std::tuple{"thread", true, false},
                                     {"tiles", false, true},
                                     {"both", true, true},
                                     {"off", false, false}}) {
    ScopedEnv env("CTXPAR_MPI_PROGRESS", mode);
    EXPECT_EQ(comm_detail::progress_settings_from_env().thread, thread) << mode;
    EXPECT_EQ(comm_detail::progress_settings_from_env().tiles, tiles) << mode;
  }
  {
    ScopedEnv us("CTXPAR_MPI_PROGRESS_US", "250");
    EXPECT_EQ(comm_detail::progress_settings_from_env().interval, 250us);
  }
  for (const char* v : {"async", "tile", "Tiles", "thread,tiles"}) {
    ScopedEnv bad("CTXPAR_MPI_PROGRESS", v);
    EXPECT_EQ(settings_error(),
              std::string("CTXPAR_MPI_PROGRESS must be 'thread' (a progress thread moves MPI "
                          "transfers while the rank computes), 'tiles' (the CPU kernel makes the "
                          "progress calls between tiles; the default), 'both' or 'off', got '") +
                  v + "'");
  }
  for (const char* v : {"0", "abc", "10ms", "200000"}) {
    ScopedEnv bad("CTXPAR_MPI_PROGRESS_US", v);
    EXPECT_EQ(settings_error(),
              std::string("CTXPAR_MPI_PROGRESS_US must be the progress calls' interval in "
                          "microseconds (the thread's poll, the tile hook's least spacing), "
                          "1..100000 (default 100), got '") +
                  v + "'");
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
