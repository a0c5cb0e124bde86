// The nccl transport's host-side logic (src/cuda/nccl_comm.*) on the CPU, against a fake NCCL
// (a NcclApi of plain C++ functions): the unique id goes through the host communicator, a
// step's transfers are one NCCL group, the watchdog aborts a transfer that never completes and
// the error names rank, peer and tag within the timeout, asynchronous errors surface, host
// collectives are delegated, bytes are counted. No GPU: streams are opaque tokens.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/nccl_comm.h"

namespace ctxpar::cuda {
namespace {

using Clock = std::chrono::steady_clock;

cudaStream_t stream_token(uintptr_t i) { return reinterpret_cast<cudaStream_t>(i); }

// The fake: NCCL calls are logged per calling thread (NCCL's groups are per thread too); marks
// are done at once unless `stall`; `async` is what ncclCommGetAsyncError reports.
struct FakeNccl {
  std::mutex mutex;
  int unique_ids = 0;
  struct Init {
    int rank, nranks, blocking;
    std::string id;
  };
  std::vector<Init> inits;
  explicit FakeNccl(bool stalls = false) : stall(stalls) {}
  std::atomic<bool> stall;
  std::atomic<int> async{ncclSuccess};
  std::atomic<int> group_end_result{ncclSuccess};
  std::atomic<int> unique_id_result{ncclSuccess};
  std::atomic<int> send_result{ncclSuccess};
  std::atomic<int> aborts{0}, destroys{0}, finalizes{0}, marks_live{0};
  static thread_local std::vector<std::string> log;

  std::shared_ptr<NcclApi> api() {
    auto a = std::make_shared<NcclApi>();
    a->get_version = [](int* v) {
      *v = 22809;
      return ncclSuccess;
    };
    a->get_unique_id = [this](ncclUniqueId* id) {
      if (unique_id_result != ncclSuccess) return ncclResult_t(unique_id_result.load());
      std::lock_guard<std::mutex> lock(mutex);
      std::memset(id, 0, sizeof *id);
      std::snprintf(id->internal, sizeof id->internal, "id-%d", ++unique_ids);
      return ncclSuccess;
    };
    a->comm_init_rank_config = [this](ncclComm_t* comm, int nranks, ncclUniqueId id, int rank,
                                      ncclConfig_t* config) {
      std::lock_guard<std::mutex> lock(mutex);
      inits.push_back({rank, nranks, config->blocking, id.internal});
      *comm = reinterpret_cast<ncclComm_t>(new int(rank));
      return ncclInProgress;  // non-blocking: settles at the next ncclCommGetAsyncError
    };
    a->comm_get_async_error = [this](ncclComm_t, ncclResult_t* state) {
      *state = ncclResult_t(async.load());
      return ncclSuccess;
    };
    a->comm_finalize = [this](ncclComm_t) {
      ++finalizes;
      return ncclSuccess;
    };
    a->comm_destroy = [this](ncclComm_t c) {
      ++destroys;
      delete reinterpret_cast<int*>(c);
      return ncclSuccess;
    };
    a->comm_abort = [this](ncclComm_t c) {
      ++aborts;
      delete reinterpret_cast<int*>(c);
      return ncclSuccess;
    };
    a->send = [this](const void*, size_t n, ncclDataType_t t, int peer, ncclComm_t,
                     cudaStream_t s) {
      log.push_back("send " + std::to_string(n) + " type " + std::to_string(t) + " to " +
                    std::to_string(peer) + " on " + std::to_string(uintptr_t(s)));
      return ncclResult_t(send_result.load());
    };
    a->recv = [](void*, size_t n, ncclDataType_t t, int peer, ncclComm_t, cudaStream_t s) {
      log.push_back("recv " + std::to_string(n) + " type " + std::to_string(t) + " from " +
                    std::to_string(peer) + " on " + std::to_string(uintptr_t(s)));
      return ncclSuccess;
    };
    a->group_start = [] {
      log.push_back("group start");
      return ncclSuccess;
    };
    a->group_end = [this] {
      log.push_back("group end");
      return ncclResult_t(group_end_result.load());
    };
    a->get_error_string = [](ncclResult_t r) {
      return r == ncclRemoteError ? "remote process exited or there was a network error"
                                  : "fake NCCL error";
    };
    a->get_last_error = [](ncclComm_t) { return ""; };
    a->set_device = [](int) {};
    a->mark = [this](cudaStream_t s) -> void* {
      log.push_back("mark on " + std::to_string(uintptr_t(s)));
      ++marks_live;
      return new int(0);
    };
    a->mark_done = [this](void*) { return stall ? 0 : 1; };
    a->mark_free = [this](void* m) {
      --marks_live;
      delete static_cast<int*>(m);
    };
    return a;
  }
  // How the communicators ended: aborted, or finalized and destroyed; no mark left behind.
  void expect_ended(int aborted, int destroyed) const {
    EXPECT_EQ(aborts, aborted);
    EXPECT_EQ(destroys, destroyed);
    EXPECT_EQ(finalizes, destroyed);
    EXPECT_EQ(marks_live, 0);
  }
};
thread_local std::vector<std::string> FakeNccl::log;

// The message of the ctxpar::Error that f throws ("" when it throws none).
template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

NcclOptions quick(int timeout_ms) {
  NcclOptions o;
  o.timeout = std::chrono::milliseconds(timeout_ms);
  return o;
}

TEST(CudaNccl, UniqueIdOfRankZeroGoesThroughTheHostCommunicator) {
  FakeNccl fake;
  run_threads(3, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api());
    EXPECT_EQ(comm.transport(), TransportKind::nccl);
    EXPECT_EQ(comm.rank(), host.rank());
    EXPECT_EQ(comm.size(), 3);
    EXPECT_EQ(host.counters().calls_of(CommKind::allgather), 1u);  // the id's broadcast
    EXPECT_EQ(device_transport(comm), static_cast<DeviceTransport*>(&comm));
    host.barrier();  // every rank initialised before the checks below
  });
  EXPECT_EQ(fake.unique_ids, 1);  // rank 0 only
  ASSERT_EQ(fake.inits.size(), 3u);
  std::vector<int> ranks;
  for (const auto& i : fake.inits) {
    EXPECT_EQ(i.id, "id-1");
    EXPECT_EQ(i.nranks, 3);
    EXPECT_EQ(i.blocking, 0) << "non-blocking communicator";
    ranks.push_back(i.rank);
  }
  std::sort(ranks.begin(), ranks.end());
  EXPECT_EQ(ranks, (std::vector<int>{0, 1, 2}));
  fake.expect_ended(0, 3);
}

TEST(CudaNccl, RankZeroFailingToMakeTheIdFailsEveryRankByName) {
  FakeNccl fake;
  fake.unique_id_result = ncclSystemError;
  run_threads(2, [&](Communicator& host) {
    EXPECT_EQ(error_of([&] { NcclCommunicator comm(host, fake.api()); }),
              "rank " + std::to_string(host.rank()) +
                  ": nccl transport: rank 0 could not make "
                  "the NCCL unique id (ncclGetUniqueId failed: fake NCCL error); check "
                  "NCCL_DEBUG=INFO on rank 0");
  });
  EXPECT_TRUE(fake.inits.empty());
}

TEST(CudaNccl, AStepIsOneGroupAndLoneTransfersAreGroupsOfOne) {
  FakeNccl fake;
  run_threads(2, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api());
    const int next = (comm.rank() + 1) % 2, prev = (comm.rank() + 1) % 2;
    std::vector<char> buf(64);
    FakeNccl::log.clear();
    comm.group_start();
    comm.group_start();  // nested: one NCCL group
    comm.send(buf.data(), 64, next, 7, stream_token(5));
    comm.group_end();
    comm.recv(buf.data(), 32, prev, 7, stream_token(5));
    comm.group_end();
    const std::string n = std::to_string(next);
    EXPECT_EQ(FakeNccl::log, (std::vector<std::string>{
                                 "group start", "send 64 type 1 to " + n + " on 5",
                                 "recv 32 type 1 from " + n + " on 5", "group end", "mark on 5"}));
    FakeNccl::log.clear();
    comm.send(buf.data(), 16, next, 8, stream_token(6));
    EXPECT_EQ(FakeNccl::log,
              (std::vector<std::string>{"group start", "send 16 type 1 to " + n + " on 6",
                                        "group end", "mark on 6"}));
    comm.wait_all();
    EXPECT_EQ(comm.pending(), 0u);
    EXPECT_EQ(comm.counters().calls_of(CommKind::send), 2u);
    EXPECT_EQ(comm.counters().calls_of(CommKind::recv), 1u);
    EXPECT_EQ(comm.counters().bytes_sent, 80u);
    EXPECT_EQ(comm.counters().bytes_received, 32u);
    EXPECT_EQ(error_of([&] { comm.group_end(); }),
              "rank " + std::to_string(comm.rank()) +
                  ": nccl transport: group_end() without a group_start()");
    EXPECT_EQ(error_of([&] { comm.send(buf.data(), 8, 5, 3, stream_token(5)); }),
              "rank " + std::to_string(comm.rank()) +
                  ": nccl transport: send to rank 5 (tag 3) "
                  "is not a rank of this communicator (0..1)");
  });
  fake.expect_ended(0, 2);
}

TEST(CudaNccl, WatchdogAbortsATransferThatNeverCompletesNamingRankPeerAndTag) {
  FakeNccl fake(/*stalls=*/true);
  run_threads(2, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api(), quick(300));
    const int peer = 1 - comm.rank();
    std::vector<char> buf(1024);
    comm.group_start();
    comm.send(buf.data(), 1024, peer, 9, stream_token(1));
    comm.recv(buf.data(), 1024, peer, 9, stream_token(1));
    comm.group_end();
    const Clock::time_point start = Clock::now();
    const std::string what = error_of([&] { comm.wait_all(); });
    const double s = std::chrono::duration<double>(Clock::now() - start).count();
    EXPECT_GE(s, 0.29);
    EXPECT_LT(s, 30.0);
    const std::string me = std::to_string(comm.rank()), p = std::to_string(peer);
    EXPECT_EQ(what, "rank " + me +
                        ": nccl transport: timed out after 0.3 s: a peer died, "
                        "hangs, or posted no matching transfer (--timeout): send to rank " +
                        p + " (tag 9, 1.0 KiB), recv from rank " + p +
                        " (tag 9, 1.0 KiB); the NCCL "
                        "communicator was aborted (ncclCommAbort)");
    // Every later call says the same.
    EXPECT_EQ(error_of([&] { comm.send(buf.data(), 8, peer, 10, stream_token(1)); }), what);
    EXPECT_EQ(error_of([&] { comm.check(); }), what);
  });
  fake.expect_ended(2, 0);
}

TEST(CudaNccl, AnAsynchronousErrorSurfacesAndAborts) {
  FakeNccl fake(/*stalls=*/true);
  run_threads(2, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api(), quick(60000));
    std::vector<char> buf(256);
    comm.recv(buf.data(), 256, 1 - comm.rank(), 4, stream_token(2));
    host.barrier();
    if (comm.rank() == 0) fake.async = ncclRemoteError;
    const Clock::time_point start = Clock::now();
    EXPECT_EQ(error_of([&] { comm.wait_all(); }),
              "rank " + std::to_string(comm.rank()) +
                  ": nccl transport: asynchronous NCCL "
                  "error: remote process exited or there was a network error: recv from rank " +
                  std::to_string(1 - comm.rank()) +
                  " (tag 4, 256 B); the NCCL communicator was "
                  "aborted (ncclCommAbort)");
    EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 30.0);
  });
  fake.expect_ended(2, 0);
}

TEST(CudaNccl, AGroupEndThatNeverSettlesFailsWithinTheTimeout) {
  FakeNccl fake;
  run_threads(1, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api(), quick(200));
    fake.group_end_result = ncclInProgress;
    fake.async = ncclInProgress;  // and it stays so
    std::vector<char> buf(8);
    EXPECT_EQ(error_of([&] { comm.send(buf.data(), 8, 0, 12, stream_token(3)); }),
              "rank 0: nccl transport: timed out after 0.2 s in ncclGroupEnd (--timeout): "
              "send to rank 0 (tag 12, 8 B); the NCCL communicator was aborted "
              "(ncclCommAbort)");
  });
  fake.expect_ended(1, 0);
}

TEST(CudaNccl, AFailingLoneSendClosesItsGroupAndAborts) {
  FakeNccl fake;
  fake.send_result = ncclInternalError;
  run_threads(1, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api());
    std::vector<char> buf(8);
    FakeNccl::log.clear();
    EXPECT_EQ(error_of([&] { comm.send(buf.data(), 8, 0, 2, stream_token(4)); }),
              "rank 0: nccl transport: ncclSend failed: fake NCCL error: send to rank 0 (tag 2, "
              "8 B); the NCCL communicator was aborted (ncclCommAbort)");
    // NCCL's group state is the thread's: the group opened for the lone send is closed.
    EXPECT_EQ(FakeNccl::log,
              (std::vector<std::string>{"group start", "send 8 type 1 to 0 on 4", "group end"}));
    FakeNccl::log.clear();
    EXPECT_NE(error_of([&] { comm.group_start(); }), "");
    EXPECT_TRUE(FakeNccl::log.empty()) << "no NCCL call after the abort";
  });
  fake.expect_ended(1, 0);
}

TEST(CudaNccl, HostCollectivesAndSplitGoThroughTheHostCommunicator) {
  FakeNccl fake;
  run_threads(4, [&](Communicator& host) {
    NcclCommunicator comm(host, fake.api());
    const int r = comm.rank();
    std::vector<int> all(4);
    comm.allgather(&r, all.data(), sizeof r);
    EXPECT_EQ(all, (std::vector<int>{0, 1, 2, 3}));
    double x = r;
    comm.allreduce(&x, 1);
    EXPECT_EQ(x, 6.0);
    EXPECT_EQ(comm.counters().calls_of(CommKind::allgather), 1u);
    EXPECT_EQ(comm.counters().sent_by(CommKind::allgather), 3 * sizeof(int));
    EXPECT_EQ(comm.counters().calls_of(CommKind::allreduce), 1u);
    std::unique_ptr<Communicator> sub = comm.split(r % 2, r);
    ASSERT_NE(sub, nullptr);
    EXPECT_EQ(sub->transport(), TransportKind::nccl);
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), r / 2);
    EXPECT_NE(device_transport(*sub), nullptr);
    sub->barrier();
    comm.barrier();
  });
  EXPECT_EQ(fake.unique_ids, 3);  // the world's, one per half
  EXPECT_EQ(fake.inits.size(), 8u);
  fake.expect_ended(0, 8);
}

}  // namespace
}  // namespace ctxpar::cuda
