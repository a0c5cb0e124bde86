// A device that hands every call to another one, for tests that watch or change what a
// strategy enqueues: derive, override what the test is about (run() sees every kernel operation
// as data), and call the base for the rest. Buffers are the inner device's (it counts and frees
// them), so this device's held / peak bytes and counters stay zero.
#pragma once
#include <cstdlib>
#include <memory>
#include <set>
#include <string>
#include <utility>

#include "ctxpar/device.h"

namespace ctxpar::testing {

class ForwardingDevice : public Device {
 public:
  explicit ForwardingDevice(std::unique_ptr<Device> inner) : inner_(std::move(inner)) {}
  std::string name() const override { return inner_->name(); }
  DeviceBuffer alloc(size_t bytes) override { return inner_->alloc(bytes); }
  DeviceBuffer upload(const void* host, size_t bytes) override {
    return inner_->upload(host, bytes);
  }
  Event record(Stream s) override { return inner_->record(s); }
  void wait(Stream s, const Event& e) override { inner_->wait(s, e); }
  void synchronize() override { inner_->synchronize(); }
  void send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) override {
    inner_->send(s, comm, buffer, peer, tag);
  }
  DeviceBuffer recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) override {
    return inner_->recv(s, comm, bytes, peer, tag);
  }
  void alltoall(Stream s, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
                size_t chunk_bytes, int tag) override {
    inner_->alltoall(s, comm, send, recv, chunk_bytes, tag);
  }
  void barrier(Stream s, Communicator& comm) override { inner_->barrier(s, comm); }
  bool lends_sent_buffers(const Communicator& comm) const override {
    return inner_->lends_sent_buffers(comm);
  }
  bool host_readable(const void* p) const override { return inner_->host_readable(p); }
  DeviceCaps caps() const override { return inner_->caps(); }
  bool adopt(void* p, size_t bytes) override { return inner_->adopt(p, bytes); }
  void run(Stream s, const Op& op) override { inner_->run(s, op); }

 protected:
  // Every buffer comes from the inner device and goes back to it; nothing is ever ours.
  void free(std::unique_ptr<DeviceBuffer::Storage>) override { std::abort(); }

 private:
  std::unique_ptr<Device> inner_;
};

// A device that leaves out the compute stream's waits for the messages it received, as a
// strategy that forgot to wait for a received K/V block would: a wait of the compute stream for
// a comm-stream event that covers a recv() (and no all-to-all, whose chunks the cpu device only
// lands at such a wait) is dropped; every other call goes through.
class SkippingReceiveWaits final : public ForwardingDevice {
 public:
  using ForwardingDevice::ForwardingDevice;
  DeviceBuffer recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) override {
    if (s == kCommStream) received_ = true;
    return ForwardingDevice::recv(s, comm, bytes, peer, tag);
  }
  void alltoall(Stream s, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
                size_t chunk_bytes, int tag) override {
    if (s == kCommStream) exchanged_ = true;
    ForwardingDevice::alltoall(s, comm, send, recv, chunk_bytes, tag);
  }
  Event record(Stream s) override {
    const Event e = ForwardingDevice::record(s);
    if (s == kCommStream) {
      if (received_ && !exchanged_) receive_events_.insert(e.seq);
      received_ = exchanged_ = false;
    }
    return e;
  }
  void wait(Stream s, const Event& e) override {
    if (s == kComputeStream && e.stream == kCommStream.index && receive_events_.count(e.seq))
      return;
    ForwardingDevice::wait(s, e);
  }

 private:
  bool received_ = false, exchanged_ = false;  // on the comm stream since its last record
  std::set<uint64_t> receive_events_;
};

// `base` with its devices of `kind` made behind SkippingReceiveWaits.
inline std::shared_ptr<const DeviceRegistry> skipping_receive_waits(
    std::shared_ptr<const DeviceRegistry> base, DeviceKind kind) {
  return base->with(kind, [base](const DeviceOptions& o, int rank) -> std::unique_ptr<Device> {
    return std::make_unique<SkippingReceiveWaits>(base->make(o, rank));
  });
}

}  // namespace ctxpar::testing
