// A transport that moves device memory itself, the one interface the cuda device asks a
// communicator for (device_transport()); a communicator without it moves host memory only, and
// the device stages through host memory for it (threads, MPI, gloo). Plain C++: streams are
// CudaApi handles, so it runs over RecordingCudaApi too. Written once here so that the device and
// the transports agree; see docs/cuda.md, "Transports". Two kinds implement it:
//
//   grouped (nccl, nccl_comm.h): send / recv are enqueued on the stream's native CUDA stream
//     (CudaApi::native_stream; the device does not use the transport where there is none):
//     they start once the stream's earlier work is done and the stream's later work starts
//     after they are done. The device holds a step's transfers and posts them between
//     group_start() and group_end() (NCCL's ncclGroupStart / ncclGroupEnd), so that a ring
//     step's send and receive progress together; recv returns no completion. check() throws the
//     error of a transfer that failed or did not complete in time (a watchdog's): the device
//     calls it after synchronizing its streams, so that a failure the streams drained past is
//     not lost.
//   immediate (loopback, loopback.h: P ranks of one process on one GPU, through one CudaApi):
//     send is enqueued on stream s at once: the bytes at `data` as they are once s's earlier
//     work is done (`data` may be reused by s's later work). recv returns a completion that the
//     device calls before the next operation of s (the receive's place in s's order): it blocks
//     the host until the peer's send is enqueued and enqueues the copy into `data` on s;
//     complete(false): the buffer is gone, drop the message.
//
// Both: `data` is device memory that stays valid until the transfer is done; a matching send /
// recv pair has the same (peer, tag) seen from each side and the same byte count; messages
// between two ranks on one tag arrive in the order sent; a transfer that cannot complete (a dead
// or stuck peer) ends with ctxpar::Error naming this rank, the peer and the tag, within the
// communicator's timeout, and never hangs; bytes are counted by the communicator (send / recv).
#pragma once
#include <cstddef>
#include <functional>

#include "ctxpar/comm.h"
#include "cuda/api.h"

namespace ctxpar::cuda {

class DeviceTransport {
 public:
  virtual ~DeviceTransport() = default;
  virtual bool grouped() const = 0;
  virtual void send(CudaApi& api, StreamHandle s, const void* data, size_t bytes, int peer,
                    int tag) = 0;
  virtual std::function<void(bool deliver)> recv(CudaApi& api, StreamHandle s, void* data,
                                                 size_t bytes, int peer, int tag) = 0;
  virtual void group_start() {}
  virtual void group_end() {}
  virtual void check() {}
};

// The communicator's device transport, or nullptr when it moves host memory only.
inline DeviceTransport* device_transport(Communicator& comm) {
  return dynamic_cast<DeviceTransport*>(&comm);
}

}  // namespace ctxpar::cuda
