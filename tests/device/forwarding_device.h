// A device that hands every call to another one, for tests that watch or change what a
// strategy enqueues: derive, override what the test is about (run() sees every kernel operation
// as data), and call the base for the rest. Buffers are the inner device's (it counts and frees
// them), so this device's held / peak bytes and counters stay zero.
#pragma once
#include <cstdlib>
#include <memory>
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

}  // namespace ctxpar::testing
