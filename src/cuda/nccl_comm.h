// The `nccl` transport: one GPU per process, device memory moved by NCCL (docs/cuda.md,
// "Transports"). A NcclCommunicator is built over a host communicator that already connects
// the ranks (mpi_world(), a gloo communicator from torchrun's store): rank 0's ncclUniqueId goes
// to every rank through it, and it stays the communicator of everything on host memory -- the
// collectives, agreement, split and host isend / irecv are its, delegated (their bytes are
// counted here too). Device memory goes through cuda::DeviceTransport: ncclSend / ncclRecv on
// the caller's stream, a step's sends and receives in one ncclGroupStart / ncclGroupEnd.
//
// Hangs end: the NCCL communicator is non-blocking (ncclConfig_t blocking = 0), and a watchdog
// thread follows each enqueued group by a completion mark (a CUDA event recorded after it) and
// the communicator's asynchronous error (ncclCommGetAsyncError). A group not done within the
// communicator's timeout, or an asynchronous error, aborts the NCCL communicator
// (ncclCommAbort: its kernels return, the streams drain) and records a ctxpar::Error naming
// this rank, the peers and the tags of the group; it is thrown by the next call (send, recv,
// group_start, group_end, check, wait_all).
//
// NCCL is loaded at run time (dlopen of libnccl.so.2), so the binary starts without it; the
// functions come through a table, NcclApi, which tests replace by a fake in plain C++ (no GPU):
// tests/cuda/nccl_comm_test.cc.
#pragma once
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/host_delegating.h"
#include "ctxpar/comm.h"
#include "cuda/device_transport.h"

namespace ctxpar::cuda {

// The NCCL functions the transport uses, and the CUDA runtime's completion marks (an event
// recorded on a stream and queried), as replaceable functions.
struct NcclApi {
  std::function<ncclResult_t(int*)> get_version;
  std::function<ncclResult_t(ncclUniqueId*)> get_unique_id;
  std::function<ncclResult_t(ncclComm_t*, int nranks, ncclUniqueId, int rank, ncclConfig_t*)>
      comm_init_rank_config;
  std::function<ncclResult_t(ncclComm_t, ncclResult_t*)> comm_get_async_error;
  std::function<ncclResult_t(ncclComm_t)> comm_finalize;
  std::function<ncclResult_t(ncclComm_t)> comm_destroy;
  std::function<ncclResult_t(ncclComm_t)> comm_abort;
  std::function<ncclResult_t(const void*, size_t, ncclDataType_t, int peer, ncclComm_t,
                             cudaStream_t)>
      send;
  std::function<ncclResult_t(void*, size_t, ncclDataType_t, int peer, ncclComm_t, cudaStream_t)>
      recv;
  std::function<ncclResult_t()> group_start;
  std::function<ncclResult_t()> group_end;
  std::function<const char*(ncclResult_t)> get_error_string;
  std::function<const char*(ncclComm_t)> get_last_error;
  // CUDA runtime: select the GPU (cudaSetDevice); a completion mark recorded on a stream
  // (cudaEventCreateWithFlags + cudaEventRecord), its state (1 done, 0 pending, -1 failed:
  // cudaEventQuery), and its release (cudaEventDestroy).
  std::function<void(int device)> set_device;
  std::function<void*(cudaStream_t)> mark;
  std::function<int(void*)> mark_done;
  std::function<void(void*)> mark_free;
};

// The real table: libnccl.so.2 by dlopen (or CTXPAR_NCCL_LIBRARY, a path), the CUDA runtime
// ctxpar is linked with. Loaded once; throws ctxpar::Error saying what was looked for and how to
// fix it when NCCL cannot be loaded.
std::shared_ptr<const NcclApi> load_nccl();

struct NcclOptions {
  int cuda_device = -1;  // the GPU of this process (cudaSetDevice); -1: the current one
  // How long a group may take, and the NCCL initialisation; -1: the host communicator's timeout.
  std::chrono::milliseconds timeout{-1};
  // How often the watchdog looks at pending groups.
  std::chrono::milliseconds poll{1};
};

class NcclCommunicator final : public HostDelegatingComm, public DeviceTransport {
 public:
  // Collective over `host`'s ranks (every rank constructs one, in the same order relative to
  // its other collectives on `host`). `host` must outlive this communicator.
  NcclCommunicator(Communicator& host, std::shared_ptr<const NcclApi> api,
                   const NcclOptions& options = {});
  // The same over a host communicator it owns (split() makes these).
  NcclCommunicator(std::unique_ptr<Communicator> host, std::shared_ptr<const NcclApi> api,
                   const NcclOptions& options = {});
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  TransportKind transport() const override { return TransportKind::nccl; }

  // Host memory and collectives: the host communicator's (HostDelegatingComm).
  // A NcclCommunicator over the host communicator's split (a new NCCL communicator, its id
  // broadcast through the split); nullptr where the host's split gives none.
  std::unique_ptr<Communicator> split(int color, int key) override;

  // Device memory (DeviceTransport, grouped): ncclSend / ncclRecv on `stream`.
  void send(const void* data, size_t bytes, int peer, int tag, cudaStream_t stream);
  void recv(void* data, size_t bytes, int peer, int tag, cudaStream_t stream);
  bool grouped() const override { return true; }
  void send(CudaApi& api, StreamHandle s, const void* data, size_t bytes, int peer,
            int tag) override {
    send(data, bytes, peer, tag, static_cast<cudaStream_t>(api.native_stream(s)));
  }
  std::function<void(bool)> recv(CudaApi& api, StreamHandle s, void* data, size_t bytes, int peer,
                                 int tag) override {
    recv(data, bytes, peer, tag, static_cast<cudaStream_t>(api.native_stream(s)));
    return {};
  }
  void group_start() override;
  void group_end() override;
  void check() override;

  // Blocks until every group enqueued so far is done; throws the watchdog's error (a timeout,
  // an asynchronous NCCL error) instead, within the timeout.
  void wait_all();
  // Groups enqueued and not yet seen done.
  size_t pending() const;

 private:
  struct Op {
    bool is_send;
    int peer;
    int tag;
    size_t bytes;
  };
  struct Pending {
    std::vector<Op> ops;
    std::vector<void*> marks;                     // one per stream the group used
    std::chrono::steady_clock::time_point start;  // restarts when it reaches the front
    std::chrono::milliseconds timeout;
  };

  void init();
  void check_peer(int peer, int tag, const char* what) const;
  void enqueue(const Op& op, cudaStream_t stream, const std::function<ncclResult_t()>& call);
  void flush_group();  // ncclGroupEnd, then the mark on the group's stream
  // Waits (in the calling thread) for the NCCL communicator to leave ncclInProgress.
  void settle(const std::vector<Op>& ops, const char* during);
  ncclResult_t locked(const std::function<ncclResult_t()>& call);
  void nccl_check(ncclResult_t r, const char* call, const std::vector<Op>& ops);
  // Aborts the NCCL communicator and records the error (under mutex_).
  void fail_locked(const std::string& why, const std::vector<Op>& ops);
  std::string describe(const std::vector<Op>& ops) const;
  void throw_if_failed_locked() const;
  void watchdog();

  std::shared_ptr<const NcclApi> api_;
  NcclOptions options_;
  ncclComm_t comm_ = nullptr;

  // Group bookkeeping (the calling thread only).
  int group_depth_ = 0;
  std::vector<Op> group_ops_;
  std::vector<cudaStream_t> group_streams_;

  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<Pending> pending_;
  std::string error_;  // the first failure; non-empty: the NCCL communicator was aborted
  bool aborted_ = false;
  bool stop_ = false;
  std::thread watchdog_;
};

// The NCCL communicator over `host` with the real NCCL (load_nccl()).
std::unique_ptr<NcclCommunicator> nccl_over(Communicator& host, const NcclOptions& options = {});

}  // namespace ctxpar::cuda
