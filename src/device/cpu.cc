// The cpu device: every operation runs inline on the calling thread (HostDevice::execute), in the
// order it is enqueued, so both streams are the host's own order. A transfer is posted when it
// is enqueued and completed when something waits for it (an event of the comm stream, or the
// host reading the received buffer): the host blocks there, as the strategies did before
// devices existed, and a transfer posted before a compute overlaps it. Sends lend their memory
// to the transport (the threads transport hands it to the receiver: no copy); the sender keeps
// a handle of its own (Buffer::share), so the memory goes only when both the sender's
// DeviceBuffer and the receiver's are gone, whichever order they go in (a receiver unwinding
// from a failed peer must not free it under a sender still computing on it). An all-to-all is
// P-1 such sends and receives (its chunks land in place at the wait), so it overlaps compute
// too.
#include <algorithm>
#include <cstring>
#include <deque>

#include <utility>

#include "device/devices.h"
#include "device/host_device.h"

namespace ctxpar::device {
namespace {

class CpuDevice;

struct CpuStorage final : DeviceBuffer::Storage {
  CpuDevice* device = nullptr;
  Buffer buffer;  // its memory (empty while a receive fills it); shared once lent
  std::byte* ptr = nullptr;
  Request transfer;  // a pending receive into this buffer, or the send it was lent to
  bool receiving = false;
  bool lent = false;  // lent to a send already: a later send sends a copy
  std::byte* data() override;
};

class CpuDevice final : public HostDevice {
 public:
  std::string name() const override { return "cpu"; }

  DeviceBuffer alloc(size_t bytes) override {
    auto s = std::make_unique<CpuStorage>();
    s->device = this;
    s->size = bytes;
    s->buffer = Buffer::uninitialized(bytes);
    s->ptr = s->buffer.data();
    return DeviceBuffer(this, std::move(s));
  }

  Event record(Stream s) override {
    if (s == kCommStream) return Event{kCommStream.index, posted_};
    return Event{};  // compute ran inline: already done
  }
  void wait(Stream, const Event& e) override {
    if (e.stream != kCommStream.index) return;
    while (!pending_.empty() && pending_.front().index < e.seq) {
      Pending p = std::move(pending_.front());
      pending_.pop_front();
      if (p.storage) complete(p.storage);
      finish(p);
    }
  }
  void synchronize() override { wait(kComputeStream, record(kCommStream)); }

  void send(Stream, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) override {
    auto* s = static_cast<CpuStorage*>(buffer.storage());
    s->data();  // a buffer still being received is complete before it is sent on
    Buffer out;
    if (!s->lent && !s->buffer.empty()) {
      out = s->buffer.share();  // lent: s->buffer keeps the memory alive for s->ptr
      s->lent = true;
    } else {  // already lent to an earlier send: send a copy
      out = Buffer::uninitialized(s->size);
      std::memcpy(out.data(), s->ptr, s->size);
    }
    Request r = comm.isend(std::move(out), peer, tag);
    if (!s->transfer.valid()) {
      s->transfer = std::move(r);
      pending_.push_back({posted_++, s});
    } else {
      pending_.push_back({posted_++, nullptr, std::move(r)});
    }
  }

  DeviceBuffer recv(Stream, Communicator& comm, size_t bytes, int peer, int tag) override {
    auto s = std::make_unique<CpuStorage>();
    s->device = this;
    s->size = bytes;
    s->transfer = comm.irecv(bytes, peer, tag);
    s->receiving = true;
    pending_.push_back({posted_++, s.get()});
    return DeviceBuffer(this, std::move(s));
  }

  // Posted, not run: a receive from every other rank into its chunk of `recv`, and a send of
  // a copy of every other rank's chunk (so `send` is free at once); the own chunk is copied
  // now. Shifted orders as Communicator::alltoall's, so that no rank is everyone's first.
  void alltoall(Stream, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
                size_t chunk_bytes, int tag) override {
    const int p = comm.size(), r = comm.rank();
    auto* into = static_cast<CpuStorage*>(recv.storage());
    const std::byte* from = send.data();
    std::byte* to = recv.data();
    for (int k = 1; k < p && chunk_bytes; ++k) {
      const int j = (r - k + p) % p;
      pending_.push_back(
          {posted_++, nullptr, comm.irecv(chunk_bytes, j, tag), into, size_t(j) * chunk_bytes});
    }
    for (int k = 1; k < p && chunk_bytes; ++k) {
      const int j = (r + k) % p;
      Buffer out = Buffer::uninitialized(chunk_bytes);
      std::memcpy(out.data(), from + size_t(j) * chunk_bytes, chunk_bytes);
      pending_.push_back({posted_++, nullptr, comm.isend(std::move(out), j, tag)});
    }
    if (chunk_bytes)
      std::memcpy(to + size_t(r) * chunk_bytes, from + size_t(r) * chunk_bytes, chunk_bytes);
  }
  void barrier(Stream, Communicator& comm) override {
    const double t0 = now_seconds();
    comm.barrier();
    counters_.wait_seconds += now_seconds() - t0;
  }
  bool lends_sent_buffers(const Communicator& comm) const override {
    return comm.shares_send_buffers();
  }

  // Blocks until s's transfer is done; a receive's message becomes its memory.
  void complete(CpuStorage* s) {
    if (!s->transfer.valid()) return;
    const double t0 = now_seconds();
    if (s->receiving) {
      s->buffer = s->transfer.take();
      s->ptr = s->buffer.data();
      s->receiving = false;
    } else {
      s->transfer.wait();  // a lent send (s->buffer holds the memory either way)
    }
    counters_.wait_seconds += now_seconds() - t0;
    s->transfer = Request();
  }

 protected:
  void free(std::unique_ptr<DeviceBuffer::Storage> storage) override {
    auto* s = static_cast<CpuStorage*>(storage.get());
    for (Pending& p : pending_) {
      if (p.storage == s) p.storage = nullptr;
      if (p.into != s) continue;
      try {
        finish(p);  // an all-to-all's chunk: lands before the memory goes
      } catch (...) {
        // As below; the chunk's place is gone either way, so nothing may write it later.
      }
      p.into = nullptr;
      p.request = Request();
    }
    try {
      if (s->transfer.valid()) complete(s);
    } catch (...) {
      // Freed while unwinding from a failed call: that failure is the one reported.
    }
  }
  // A kernel operation runs now, on the calling thread.
  void execute(Stream, const char*, Views, Views, const Work& work) override { work(); }

 private:
  struct Pending {
    uint64_t index;
    CpuStorage* storage;         // null once its buffer is freed (completed then)
    Request request = {};        // the send of a copy (the buffer was lent already), or an
    CpuStorage* into = nullptr;  // all-to-all's chunk, received into `into` at `offset`
    size_t offset = 0;
  };

  // Completes p's own request: waits for a send; copies a received chunk into place.
  void finish(Pending& p) {
    if (!p.request.valid()) return;
    const double t0 = now_seconds();
    if (p.into) {
      Buffer b = p.request.take();
      std::memcpy(p.into->ptr + p.offset, b.data(), b.size());
      p.into = nullptr;
    } else {
      p.request.wait();
      p.request = Request();
    }
    counters_.wait_seconds += now_seconds() - t0;
  }
  std::deque<Pending> pending_;
  uint64_t posted_ = 0;
};

std::byte* CpuStorage::data() {
  if (receiving) device->complete(this);
  return ptr;
}

}  // namespace

std::unique_ptr<Device> make_cpu() { return std::make_unique<CpuDevice>(); }

}  // namespace ctxpar::device
