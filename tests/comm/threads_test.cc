// The threads transport: zero-copy hand-over, the simulated link's timing, and failures
// (each bounded in time: nothing may hang).
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <limits>
#include <string>
#include <thread>

#include "ctxpar/comm.h"
#include "sanitizers.h"

namespace ctxpar {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

double seconds_since(Clock::time_point t) {
  return std::chrono::duration<double>(Clock::now() - t).count();
}

// Runs and returns the Error's message, or "" if nothing was thrown.
std::string failure_of(int p, const std::function<void(Communicator&)>& fn,
                       const ThreadsOptions& options = {}) {
  try {
    run_threads(p, fn, options);
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

TEST(Threads, SendHandsTheBufferOverWithoutCopying) {
  std::atomic<const std::byte*> sent{nullptr};
  run_threads(2, [&](Communicator& comm) {
    if (comm.rank() == 0) {
      Buffer b(1 << 20);
      sent = b.data();
      comm.isend(std::move(b), 1, 0).wait();
    } else {
      Buffer b = comm.irecv(1 << 20, 0, 0).take();
      EXPECT_EQ(b.data(), sent.load());
    }
  });
}

TEST(Threads, TestPollsWithoutBlocking) {
  run_threads(2, [](Communicator& comm) {
    if (comm.rank() == 1) {
      Request r = comm.irecv(4, 0, 1);
      EXPECT_FALSE(r.test());  // rank 0 sends only after the barrier
      comm.barrier();
      while (!r.test()) std::this_thread::yield();
      EXPECT_EQ(r.take().size(), 4u);
    } else {
      comm.barrier();
      comm.isend(Buffer(4), 1, 1).wait();
    }
  });
}

TEST(Threads, BarrierHoldsEveryRankUntilAllArrive) {
  for (int p : {2, 3, 5, 8}) {
    std::atomic<int> arrived{0};
    run_threads(p, [&](Communicator& comm) {
      // Late arrivals: a rank leaving early would see fewer than p.
      std::this_thread::sleep_for(milliseconds(2 * comm.rank()));
      arrived++;
      comm.barrier();
      EXPECT_EQ(arrived.load(), p);
      comm.barrier();
    });
  }
}

// Link model: delivery = latency + bytes / bandwidth after the send, one message at a time
// per outgoing link. Lower bounds are exact (the transport must not deliver early); upper
// bounds leave room for a busy machine.
TEST(Threads, SimulatedLinkDelaysDeliveries) {
  ThreadsOptions options;
  options.link = {/*gbytes_per_second=*/1.0, /*latency_us=*/2000};
  const size_t bytes = 4'000'000;  // 4 ms on the wire at 1 GB/s
  // slack: a loaded 2-core machine under ASan stalls a thread for up to ~1 s (the lower bounds
  // are the check; the upper ones catch a delivery that never happens or waits for a timeout).
  const double wire = 0.004, latency = 0.002, slack = 2.0;
  std::atomic<int64_t> start_ns{0};
  run_threads(
      2,
      [&](Communicator& comm) {
        comm.barrier();
        if (comm.rank() == 0) {
          const auto t0 = Clock::now();
          start_ns = t0.time_since_epoch().count();
          Request a = comm.isend(Buffer(bytes), 1, 0);
          Request b = comm.isend(Buffer(bytes), 1, 1);
          a.wait();
          EXPECT_GE(seconds_since(t0), wire);  // the first message's last byte has left
          b.wait();
          EXPECT_GE(seconds_since(t0), 2 * wire);  // the second waited for the first
        } else {
          Request a = comm.irecv(bytes, 0, 0), b = comm.irecv(bytes, 0, 1);
          a.wait();
          const auto t0 = Clock::time_point(Clock::duration(start_ns.load()));
          const double first = seconds_since(t0);
          b.wait();
          const double second = seconds_since(t0);
          EXPECT_GE(first, wire + latency);
          EXPECT_LT(first, wire + latency + slack);
          EXPECT_GE(second, 2 * wire + latency);
          EXPECT_LT(second, 2 * wire + latency + slack);
        }
      },
      options);
}

TEST(Threads, NoLinkDeliversAtOnce) {
  run_threads(2, [&](Communicator& comm) {
    comm.barrier();
    const auto t0 = Clock::now();
    if (comm.rank() == 0)
      comm.isend(Buffer(4'000'000), 1, 0).wait();
    else
      comm.irecv(4'000'000, 0, 0).wait();
    EXPECT_LT(seconds_since(t0),
              2.0);  // nothing is modelled: only scheduling delays (loaded machine)
  });
}

TEST(ThreadsFaults, RankThrowingMidExchangeStopsEveryRankPromptly) {
  ThreadsOptions options;
  options.timeout = std::chrono::seconds(60);  // must not be what ends it
  const auto t0 = Clock::now();
  const std::string msg = failure_of(
      4,
      [](Communicator& comm) {
        const int p = comm.size(), r = comm.rank();
        for (int step = 0; step < 10; ++step) {
          if (r == 2 && step == 3) throw Error("boom at step 3");
          Request rq = comm.irecv(1024, (r + p - 1) % p, step);
          comm.isend(Buffer(1024), (r + 1) % p, step).wait();
          rq.wait();
        }
        comm.barrier();
      },
      options);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_EQ(msg, "rank 2 failed: boom at step 3");
}

TEST(ThreadsFaults, OthersSeeWhichRankFailed) {
  std::atomic<int> told{0};
  const std::string msg = failure_of(3, [&](Communicator& comm) {
    if (comm.rank() == 1) throw std::runtime_error("bad input");
    try {
      comm.barrier();
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find("rank 1 failed: bad input"), std::string::npos)
          << e.what();
      told++;
      throw;
    }
  });
  EXPECT_EQ(msg, "rank 1 failed: bad input");
  EXPECT_EQ(told.load(), 2);
}

TEST(ThreadsFaults, WaitTimesOutNamingRankPeerAndTag) {
  ThreadsOptions options;
  options.timeout = milliseconds(300);
  const auto t0 = Clock::now();
  const std::string msg = failure_of(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0)
          comm.irecv(8, 1, 7).wait();  // rank 1 never sends it
        else
          std::this_thread::sleep_for(milliseconds(2000));  // stalls of ~1 s happen under load
      },
      options);
  EXPECT_EQ(msg,
            "rank 0 failed: rank 0: timed out after 0.3 s waiting for recv from rank 1 (tag 7)");
  EXPECT_GE(seconds_since(t0), 0.3);
  EXPECT_LT(seconds_since(t0), 5.0);
}

TEST(ThreadsFaults, WaitingForARankThatReturnedFailsAtOnce) {
  const auto t0 = Clock::now();
  const std::string msg = failure_of(2, [](Communicator& comm) {
    if (comm.rank() == 0) comm.irecv(8, 1, 4).wait();
  });
  EXPECT_LT(seconds_since(t0), 5.0);  // the 120 s default timeout is not what ended it
  EXPECT_NE(msg.find("rank 1 has returned without sending it"), std::string::npos) << msg;
}

TEST(ThreadsFaults, ReceiveOfWrongSizeNamesBothSizes) {
  const std::string msg = failure_of(2, [](Communicator& comm) {
    if (comm.rank() == 0)
      comm.isend(Buffer(8), 1, 3).wait();
    else
      comm.irecv(16, 0, 3).wait();
  });
  EXPECT_EQ(msg,
            "rank 1 failed: rank 1: recv from rank 0 (tag 3) expected 16 bytes, but the "
            "message has 8 bytes");
}

TEST(ThreadsFaults, CollectiveSkippedByOneRankFails) {
  ThreadsOptions options;
  options.timeout = std::chrono::seconds(30);  // must not be what ends it
  // Rank 1 skips the all-gather and goes on to a barrier: the ranks see a message of another
  // collective with the same call number and fail at once.
  const auto t0 = Clock::now();
  std::string msg = failure_of(
      3,
      [](Communicator& comm) {
        float x[3] = {}, y = 1;
        if (comm.rank() != 1) comm.allgather(&y, x, sizeof(float));
        comm.barrier();
      },
      options);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(msg.find("collective mismatch"), std::string::npos) << msg;
  EXPECT_NE(msg.find("rank 1"), std::string::npos) << msg;
  // Rank 1 skips and returns: the ranks waiting for it fail at once.
  msg = failure_of(
      3,
      [](Communicator& comm) {
        double v = 1;
        if (comm.rank() != 1) comm.allreduce(&v, 1);
      },
      options);
  EXPECT_LT(seconds_since(t0), 5.0);
  EXPECT_NE(msg.find("rank 1 has returned without sending it"), std::string::npos) << msg;
  // Rank 2 skips one all-reduce then waits on a user message nobody sends: the ranks still in
  // the all-reduce wait for rank 2's share, so the timeout ends it.
  options.timeout = std::chrono::milliseconds(400);
  msg = failure_of(
      3,
      [](Communicator& comm) {
        double v = 1;
        if (comm.rank() != 2)
          comm.allreduce(&v, 1);
        else
          comm.irecv(8, 0, 1).wait();
      },
      options);
  EXPECT_NE(msg.find("timed out after 0.4 s waiting for recv from rank"), std::string::npos) << msg;
  EXPECT_LT(seconds_since(t0), 8.0);
}

TEST(ThreadsFaults, InvalidArgumentsAreErrors) {
  run_threads(2, [](Communicator& comm) {
    EXPECT_THROW(comm.isend(Buffer(4), 2, 0), Error);
    EXPECT_THROW(comm.irecv(4, -1, 0), Error);
    EXPECT_THROW(comm.isend(Buffer(4), 1, -5), Error);
    try {
      comm.irecv(4, 5, 0);
    } catch (const Error& e) {
      EXPECT_STREQ(e.what(), "irecv: peer must be in [0, 2), got 5");
    }
  });
  EXPECT_THROW(run_threads(0, [](Communicator&) {}), Error);
  ThreadsOptions bad;
  bad.link.gbytes_per_second = -1;
  EXPECT_THROW(run_threads(
                   2, [](Communicator&) {}, bad),
               Error);
}

TEST(ThreadsFaults, NonStandardExceptionIsReported) {
  const std::string msg = failure_of(2, [](Communicator& comm) {
    if (comm.rank() == 0) throw 42;
    comm.barrier();
  });
  EXPECT_NE(msg.find("rank 0 failed: unknown exception"), std::string::npos) << msg;
}

TEST(ThreadsFaults, DroppedReceiveDoesNotSwallowALaterMessage) {
  run_threads(2, [](Communicator& comm) {
    if (comm.rank() == 1) {
      { Request dropped = comm.irecv(4, 0, 0); }
      comm.barrier();
      Buffer b = comm.irecv(4, 0, 0).take();
      EXPECT_EQ(b.as<int>()[0], 99);
    } else {
      comm.barrier();
      Buffer b(4);
      b.as<int>()[0] = 99;
      comm.isend(std::move(b), 1, 0).wait();
    }
  });
}

// ---- at the limits: too many ranks, a system that refuses a thread, a simulated link too slow
// (or too strange) to model. Each must end in an Error that says what happened, promptly:
// never an abort, a hang, or a link silently switched off.

bool has(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

TEST(ThreadsLimits, TooManyRanksAreRefusedBeforeAnyThreadStarts) {
  std::atomic<int> started{0};
  const auto t0 = Clock::now();
  const std::string msg =
      failure_of(kMaxThreadsRanks + 1, [&](Communicator&) { started.fetch_add(1); });
  EXPECT_TRUE(has(msg, std::to_string(kMaxThreadsRanks + 1) + " ranks is more than")) << msg;
  EXPECT_TRUE(has(msg, "use MPI")) << msg;
  EXPECT_EQ(started.load(), 0);
  EXPECT_LT(seconds_since(t0), 1.0);
}

// Virtual memory in use now (VmSize), in bytes.
long long vm_size_bytes() {
  std::ifstream in("/proc/self/status");
  std::string key;
  long long kb = -1;
  while (in >> key) {
    if (key == "VmSize:") {
      in >> kb;
      break;
    }
    in.ignore(1 << 12, '\n');
  }
  return kb * 1024;
}

// The system refuses threads once the address space is nearly full (each thread's stack is a
// mapping of its own; RLIMIT_AS binds root too, unlike RLIMIT_NPROC). In a child process, so
// the limit and any abort stay there: exit 0 = the Error came with the expected message;
// 3 = wrong message; 4 = no error at all; a signal = the abort this test guards against.
TEST(ThreadsLimits, RefusedThreadIsAnErrorAndStopsTheStartedRanks) {
  CTXPAR_SKIP_UNDER_SANITIZER();
  if (vm_size_bytes() <= 0) GTEST_SKIP() << "no /proc/self/status VmSize";
  const pid_t child = fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    const rlim_t cap = static_cast<rlim_t>(vm_size_bytes() + (48ll << 20));
    rlimit lim{cap, cap};
    if (setrlimit(RLIMIT_AS, &lim) != 0) _exit(5);
    int code = 4;
    try {
      // Every rank waits in a barrier: the started ones can only leave it by being stopped.
      run_threads(kMaxThreadsRanks, [](Communicator& comm) { comm.barrier(); });
    } catch (const Error& e) {
      const std::string msg = e.what();
      code = has(msg, "the system refused thread") && has(msg, "ranks already started were stopped")
                 ? 0
                 : 3;
      if (code) std::fprintf(stderr, "message: %s\n", msg.c_str());
    }
    _exit(code);
  }
  int status = 0;
  const auto t0 = Clock::now();
  ASSERT_EQ(waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status)
                                 << " (SIGABRT = " << SIGABRT << ")";
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: wrong message, 4: no error, 5: setrlimit failed";
  EXPECT_LT(seconds_since(t0), 30.0);
}

// 1e-300 GB/s once overflowed the delivery time into the past: the link read as "off".
TEST(ThreadsLimits, LinkTooSlowForTheTimeoutFailsAtTheSend) {
  ThreadsOptions o;
  o.link.gbytes_per_second = 1e-300;
  o.timeout = std::chrono::seconds(5);
  const auto t0 = Clock::now();
  const std::string msg = failure_of(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0)
          comm.isend(Buffer(1024), 1, 0).wait();
        else
          comm.irecv(1024, 0, 0).take();
      },
      o);
  EXPECT_TRUE(has(msg, "rank 0 failed: rank 0: the simulated link (1e-300 GB/s")) << msg;
  EXPECT_TRUE(has(msg, "past the 5 s timeout")) << msg;
  EXPECT_LT(seconds_since(t0), 3.0);

  o.link.gbytes_per_second = 0;
  o.link.latency_us = 1e300;  // finite, but far past any timeout
  const std::string late = failure_of(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0)
          comm.isend(Buffer(8), 1, 0).wait();
        else
          comm.irecv(8, 0, 0).take();
      },
      o);
  EXPECT_TRUE(has(late, "the simulated link (0 GB/s, 1e+300 us latency)")) << late;
}

TEST(ThreadsLimits, NonFiniteLinkIsRefused) {
  ThreadsOptions o;
  o.link.latency_us = std::numeric_limits<double>::infinity();
  EXPECT_TRUE(has(failure_of(
                      2, [](Communicator&) {}, o),
                  "link.latency_us must be finite"));
  o.link.latency_us = 0;
  o.link.gbytes_per_second = std::nan("");
  EXPECT_TRUE(has(failure_of(
                      2, [](Communicator&) {}, o),
                  "link.gbytes_per_second must be finite"));
}

// A slow link that does fit in the timeout still works, and still delays.
TEST(ThreadsLimits, SlowLinkWithinTheTimeoutDelivers) {
  ThreadsOptions o;
  o.link.gbytes_per_second = 1e-6;  // 1 kB/s: 100 bytes take 0.1 s
  const auto t0 = Clock::now();
  run_threads(
      2,
      [](Communicator& comm) {
        if (comm.rank() == 0)
          comm.isend(Buffer(100), 1, 0).wait();
        else
          EXPECT_EQ(comm.irecv(100, 0, 0).take().size(), 100u);
      },
      o);
  EXPECT_GE(seconds_since(t0), 0.09);
}

}  // namespace
}  // namespace ctxpar
