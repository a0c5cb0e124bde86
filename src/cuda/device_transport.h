// A transport that moves device memory itself, enqueued on a CUDA stream (nccl; the cuda
// device's staging through host memory is for the others: threads, MPI, gloo). The cuda device
// (cuda_device.cc) asks a communicator for this interface (device_transport()) and, where it
// has one, hands it device pointers instead of staging. Written once here so that the device
// and the transports agree; see docs/cuda.md, "Transports".
//
// Contract:
//   - send / recv are enqueued on `stream`: they start once the stream's earlier work is done
//     and the stream's later work starts after they are done. `data` is device memory that
//     stays valid until then.
//   - A matching send / recv pair has the same (peer, tag) seen from each side and the same
//     byte count; messages between two ranks on one tag arrive in the order sent.
//   - group_start() ... group_end() brackets the sends and receives of one step (a ring step's
//     send to the next rank and receive from the previous), so that they progress together
//     (NCCL's ncclGroupStart / ncclGroupEnd); calls outside a group are groups of one.
//   - A transfer that cannot complete (a dead or stuck peer) ends with ctxpar::Error naming this
//     rank, the peer and the tag, from the call or from the device's next synchronize(), within
//     the communicator's timeout; it never hangs (NCCL: non-blocking communicators and
//     ncclCommAbort from a watchdog).
//   - Bytes are counted in the communicator's counters (send / recv), as for host transfers.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>

#include "ctxpar/comm.h"

namespace ctxpar::cuda {

class DeviceTransport {
 public:
  virtual ~DeviceTransport() = default;
  virtual void send(const void* data, size_t bytes, int peer, int tag, cudaStream_t stream) = 0;
  virtual void recv(void* data, size_t bytes, int peer, int tag, cudaStream_t stream) = 0;
  virtual void group_start() = 0;
  virtual void group_end() = 0;
  // Throws the error of a transfer that failed or did not complete in time (a watchdog's), if
  // any: the device calls it after synchronizing its streams, so that a failure the streams
  // drained past is not lost. The default has nothing to report.
  virtual void check() {}
};

// The communicator's device transport, or nullptr when it moves host memory only
// (dynamic_cast: a communicator that moves device memory also derives from DeviceTransport).
inline DeviceTransport* device_transport(Communicator& comm) {
  return dynamic_cast<DeviceTransport*>(&comm);
}

}  // namespace ctxpar::cuda
