// A transport that moves device memory through a CudaApi (the loopback transport: P ranks of
// one process on one GPU, loopback.h). The cuda device asks a communicator for it first
// (api_transport()), then for a DeviceTransport (nccl, device_transport.h), else stages through
// host memory. Plain C++: it runs over RecordingCudaApi too.
//
//   send: enqueued on stream s of `api`: the bytes at `data` (device memory) as they are once
//     s's earlier work is done; `data` may be reused by s's later work.
//   recv: returns a completion that the device calls before the next operation of s (the
//     receive's place in s's order): it blocks the host until the peer's send is enqueued
//     (timeout: the communicator's, naming this rank, the peer and the tag; it never hangs) and
//     enqueues the copy into `data` on s. complete(false): the buffer is gone, drop the message.
//   Messages between two ranks on one tag arrive in the order sent; bytes are counted by the
//   communicator (send / recv).
#pragma once
#include <cstddef>
#include <functional>

#include "ctxpar/comm.h"
#include "cuda/api.h"

namespace ctxpar::cuda {

class ApiTransport {
 public:
  virtual ~ApiTransport() = default;
  virtual void send(CudaApi& api, StreamHandle s, const void* data, size_t bytes, int peer,
                    int tag) = 0;
  virtual std::function<void(bool deliver)> recv(CudaApi& api, StreamHandle s, void* data,
                                                 size_t bytes, int peer, int tag) = 0;
};

inline ApiTransport* api_transport(Communicator& comm) {
  return dynamic_cast<ApiTransport*>(&comm);
}

}  // namespace ctxpar::cuda
