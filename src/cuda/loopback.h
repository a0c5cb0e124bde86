// The loopback transport: P ranks of one process on one GPU (threads, one per rank, as the
// threads transport), exchanging device memory by device-to-device copies ordered by events,
// all through one CudaApi (so RecordingCudaApi runs it on the CPU). Host collectives and host
// point-to-point messages go to the in-process threads world it wraps (`host`), counted here.
//
//   send: the sender copies the bytes into a staging allocation on its stream, records an event
//     and posts {staging, event} to the world's mailbox for (context, sender, receiver, tag).
//   recv's completion: waits for that post (the communicator's timeout, naming rank, peer and
//     tag), makes the receiver's stream wait for the event, copies staging -> destination and
//     frees the staging there (stream-ordered).
// A sub-communicator (split) keeps the world and takes a context number of its own, the same
// on every member, so its messages never meet its parent's.
#pragma once
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <tuple>

#include "comm/host_delegating.h"
#include "ctxpar/comm.h"
#include "cuda/device_transport.h"

namespace ctxpar::cuda {

class LoopbackWorld {
 public:
  explicit LoopbackWorld(std::shared_ptr<CudaApi> api);
  ~LoopbackWorld();  // frees staging no receiver took
  const std::shared_ptr<CudaApi>& api() const { return api_; }

  struct Message {
    void* staging = nullptr;
    size_t bytes = 0;
    EventHandle ready = nullptr;
  };
  using Key = std::tuple<uint64_t, int, int, int>;  // context, sender, receiver, tag
  void post(const Key& key, const Message& m);
  // Blocks until a message for key is posted; throws naming rank, peer and tag after `timeout`.
  Message take(const Key& key, std::chrono::milliseconds timeout);

 private:
  std::shared_ptr<CudaApi> api_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, std::deque<Message>> box_;
};

class LoopbackComm final : public HostDelegatingComm, public DeviceTransport {
 public:
  LoopbackComm(Communicator& host, std::shared_ptr<LoopbackWorld> world, uint64_t context = 1);
  LoopbackComm(std::unique_ptr<Communicator> host, std::shared_ptr<LoopbackWorld> world,
               uint64_t context);

  TransportKind transport() const override { return TransportKind::loopback; }
  // Host memory and collectives: the wrapped threads world's (HostDelegatingComm).
  std::unique_ptr<Communicator> split(int color, int key) override;

  // Device memory (DeviceTransport, immediate).
  bool grouped() const override { return false; }
  void send(CudaApi& api, StreamHandle s, const void* data, size_t bytes, int peer,
            int tag) override;
  std::function<void(bool)> recv(CudaApi& api, StreamHandle s, void* data, size_t bytes, int peer,
                                 int tag) override;

 private:
  std::shared_ptr<LoopbackWorld> world_;
  uint64_t context_;
};

}  // namespace ctxpar::cuda
