// The loopback transport (loopback.h).
#include "cuda/loopback.h"

#include <string>

#include "ctxpar/error.h"

namespace ctxpar::cuda {

LoopbackWorld::LoopbackWorld(std::shared_ptr<CudaApi> api) : api_(std::move(api)) {}

LoopbackWorld::~LoopbackWorld() {
  StreamHandle s = nullptr;
  for (auto& [key, q] : box_)
    for (Message& m : q) {
      if (!s) s = api_->stream_create();
      api_->stream_wait_event(s, m.ready);
      api_->free_async(m.staging, s);
      api_->event_destroy(m.ready);
    }
  if (s) {
    api_->stream_synchronize(s);
    api_->stream_destroy(s);
  }
}

void LoopbackWorld::post(const Key& key, const Message& m) {
  {
    std::lock_guard<std::mutex> l(mu_);
    box_[key].push_back(m);
  }
  cv_.notify_all();
}

LoopbackWorld::Message LoopbackWorld::take(const Key& key, std::chrono::milliseconds timeout) {
  std::unique_lock<std::mutex> l(mu_);
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    auto it = box_.find(key);
    if (it != box_.end() && !it->second.empty()) {
      Message m = it->second.front();
      it->second.pop_front();
      return m;
    }
    if (cv_.wait_until(l, deadline) == std::cv_status::timeout &&
        std::chrono::steady_clock::now() >= deadline) {
      auto again = box_.find(key);
      if (again != box_.end() && !again->second.empty()) continue;
      throw Error("rank " + std::to_string(std::get<2>(key)) + ": timed out after " +
                  std::to_string(timeout.count() / 1000.0) +
                  " s waiting for a loopback message from rank " +
                  std::to_string(std::get<1>(key)) + " (tag " + std::to_string(std::get<3>(key)) +
                  ")");
    }
  }
}

LoopbackComm::LoopbackComm(Communicator& host, std::shared_ptr<LoopbackWorld> world,
                           uint64_t context)
    : HostDelegatingComm(host), world_(std::move(world)), context_(context) {
  set_timeout(host.timeout());
}

LoopbackComm::LoopbackComm(std::unique_ptr<Communicator> host, std::shared_ptr<LoopbackWorld> world,
                           uint64_t context)
    : HostDelegatingComm(std::move(host)), world_(std::move(world)), context_(context) {
  set_timeout(host_comm().timeout());
}

std::unique_ptr<Communicator> LoopbackComm::split(int color, int key) {
  host_comm().set_timeout(timeout());
  std::unique_ptr<Communicator> sub = host_comm().split(color, key);
  // The same number on every member of the sub-group (same parent, same color).
  const uint64_t context = context_ * 1000003u + uint64_t(color) + 1;
  return std::make_unique<LoopbackComm>(std::move(sub), world_, context);
}

void LoopbackComm::send(CudaApi& api, StreamHandle s, const void* data, size_t bytes, int peer,
                        int tag) {
  LoopbackWorld::Message m;
  m.bytes = bytes;
  m.staging = api.malloc_async(bytes, s);
  api.memcpy_async(m.staging, data, bytes, CopyKind::device_to_device, s);
  m.ready = api.event_create(false);
  api.event_record(m.ready, s);
  world_->post({context_, rank(), peer, tag}, m);
  count(CommKind::send, bytes, 0);
}

std::function<void(bool)> LoopbackComm::recv(CudaApi& api, StreamHandle s, void* data, size_t bytes,
                                             int peer, int tag) {
  count(CommKind::recv, 0, bytes);
  const LoopbackWorld::Key key{context_, peer, rank(), tag};
  return [this, &api, s, data, bytes, key](bool deliver) {
    const LoopbackWorld::Message m = world_->take(key, timeout_);
    // The staging and its event are released whatever happens (a size that does not match, a
    // failed copy), after the wait when it was made: the sender's copy may still be writing.
    bool waited = false;
    auto release = [&] {
      if (waited) api.free_async(m.staging, s);  // else leaked: never freed under a writer
      api.event_destroy(m.ready);
    };
    try {
      api.stream_wait_event(s, m.ready);
      waited = true;
      if (deliver) {
        CTXPAR_CHECK(m.bytes == bytes, "rank ", std::get<2>(key), ": a loopback message of ",
                     m.bytes, " bytes from rank ", std::get<1>(key), " (tag ", std::get<3>(key),
                     ") where ", bytes, " were expected");
        api.memcpy_async(data, m.staging, bytes, CopyKind::device_to_device, s);
      }
    } catch (...) {
      try {
        release();
      } catch (...) {  // the first error is the one in flight
      }
      throw;
    }
    release();
  };
}

}  // namespace ctxpar::cuda
