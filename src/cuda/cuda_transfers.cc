// The cuda device's transfers (cuda_device.h): through the communicator's DeviceTransport
// (device_transport.h: an immediate one, or a grouped one where the API has native streams),
// otherwise staged through host memory (device.h's rules: the communicator's timeout names the peer, a failed
// peer ends in ctxpar::Error, bytes are counted by the communicator).
#include <cstring>

#include "ctxpar/error.h"
#include "cuda/cuda_device_impl.h"
#include "cuda/device_transport.h"

namespace ctxpar::cuda {
namespace {

// The communicator's device transport as the device uses it on s: an immediate one always; a
// grouped one where s has a native stream (its check() then called at the next synchronize),
// else none (the transfer is staged through host memory).
DeviceTransport* transport_of(Communicator& comm, CudaApi& api, StreamHandle s,
                              std::vector<std::pair<const void*, std::function<void()>>>& checks) {
  DeviceTransport* t = device_transport(comm);
  if (!t || !t->grouped()) return t;
  if (!api.native_stream(s)) return nullptr;
  bool known = false;
  for (auto& c : checks) known = known || c.first == t;
  if (!known) checks.emplace_back(t, [t] { t->check(); });
  return t;
}

}  // namespace

// The messages received for s land on the device before anything later on s runs: the host
// waits for each (timeout: the communicator's, naming the peer) and copies it in on s.
void CudaDevice::flush_receives(Stream s, const Storage* only) {
  auto& q = receives_[s.index];
  if (only) {  // only up to the last receive into `only` (a send of it must wait for those)
    size_t last = q.size();
    for (size_t i = 0; i < q.size(); ++i)
      if (q[i].into == only) last = i;
    if (last == q.size()) return;
    for (size_t i = 0; i <= last; ++i) flush_receives_front(s);
    return;
  }
  while (!q.empty()) flush_receives_front(s);
}

void CudaDevice::flush_receives_front(Stream s) {
  auto& q = receives_[s.index];
  {
    PendingReceive r = std::move(q.front());
    q.pop_front();
    if (r.into && !r.into->ordered[s.index]) {  // the copy in comes after the allocation
      api_->stream_wait_event(stream(s), r.into->alloc_event);
      r.into->ordered[s.index] = true;
    }
    if (r.complete) {  // an immediate DeviceTransport's: it enqueues its own copy on s
      host_wait([&] { r.complete(r.into != nullptr); });
      return;
    }
    Buffer b;
    host_wait([&] { b = r.request.take(); });
    if (!r.into) return;  // freed meanwhile: the message is dropped
    if (b.size())
      api_->memcpy_async(r.into->ptr + r.offset, b.data(), b.size(), CopyKind::host_to_device,
                         stream(s));
    keep_.push_back(std::move(b));  // a copy may read it until the stream passes it
  }
}

void CudaDevice::flush_device_sends(Stream s) {
  std::vector<std::function<void()>>& q = device_sends_[s.index];
  if (q.empty()) return;
  std::vector<std::function<void()>> sends = std::move(q);
  q.clear();
  // Every held send went through a grouped DeviceTransport; one group for all of them.
  DeviceTransport* t = nullptr;
  for (auto& c : transport_checks_)
    t = t ? t : static_cast<DeviceTransport*>(const_cast<void*>(c.first));
  if (t) t->group_start();
  for (auto& post : sends) post();
  if (t) t->group_end();
}

void CudaDevice::order_transfer(Stream s, Storage* st) {
  flush_receives(s, st);
  if (st->ordered[s.index]) return;
  api_->stream_wait_event(stream(s), st->alloc_event);
  st->ordered[s.index] = true;
}

// A send (or all-to-all) does not wait for the stream's other pending receives (the host would block on a
// peer that is itself about to send to us: a ring posts both before either completes).
void CudaDevice::send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) {
  auto* st = static_cast<Storage*>(buffer.storage());
  order_transfer(s, st);
  DeviceTransport* t = transport_of(comm, *api_, stream(s), transport_checks_);
  if (t && !t->grouped()) {
    t->send(*api_, stream(s), st->ptr, st->size, peer, tag);
    return;
  }
  if (t) {
    device_sends_[s.index].push_back([t, api = api_.get(), sh = stream(s), ptr = st->ptr,
                                      n = st->size, peer,
                                      tag] { t->send(*api, sh, ptr, n, peer, tag); });
    return;
  }
  flush_device_sends(s);
  Buffer out = Buffer::uninitialized(st->size);
  if (st->size)
    api_->memcpy_async(out.data(), st->ptr, st->size, CopyKind::device_to_host, stream(s));
  host_wait([&] { api_->stream_synchronize(stream(s)); });
  sends_.push_back(comm.isend(std::move(out), peer, tag));
}

DeviceBuffer CudaDevice::recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) {
  DeviceBuffer b = alloc(bytes);
  auto* st = static_cast<Storage*>(b.storage());
  DeviceTransport* t = transport_of(comm, *api_, stream(s), transport_checks_);
  if (t && !t->grouped()) {
    PendingReceive r;
    r.into = st;
    r.complete = t->recv(*api_, stream(s), st->ptr, bytes, peer, tag);
    receives_[s.index].push_back(std::move(r));
    return b;
  }
  if (t) {
    order_transfer(s, st);
    device_sends_[s.index].push_back([t, api = api_.get(), sh = stream(s), ptr = st->ptr, bytes,
                                      peer, tag] { t->recv(*api, sh, ptr, bytes, peer, tag); });
    return b;
  }
  receives_[s.index].push_back(PendingReceive{comm.irecv(bytes, peer, tag), st, 0, {}});
  return b;
}

// Chunk j of `send` to rank j, chunk i of `recv` from rank i, in Communicator::alltoall's
// shifted orders; the own chunk is a device-to-device copy on s.
void CudaDevice::alltoall(Stream s, Communicator& comm, const DeviceBuffer& send,
                          const DeviceBuffer& recv, size_t chunk_bytes, int tag) {
  const int p = comm.size(), r = comm.rank();
  auto* from = static_cast<Storage*>(send.storage());
  auto* into = static_cast<Storage*>(recv.storage());
  CTXPAR_CHECK(from->size >= size_t(p) * chunk_bytes && into->size >= size_t(p) * chunk_bytes,
               "alltoall: buffers of ", from->size, " and ", into->size, " bytes for ", p,
               " chunks of ", chunk_bytes);
  order_transfer(s, from);
  order_transfer(s, into);
  if (chunk_bytes == 0) return;
  DeviceTransport* t = transport_of(comm, *api_, stream(s), transport_checks_);
  if (t && !t->grouped()) {
    for (int k = 1; k < p; ++k) {
      const int j = (r + k) % p;
      t->send(*api_, stream(s), from->ptr + size_t(j) * chunk_bytes, chunk_bytes, j, tag);
    }
    for (int k = 1; k < p; ++k) {
      const int j = (r - k + p) % p;
      PendingReceive pr;
      pr.into = into;
      pr.complete =
          t->recv(*api_, stream(s), into->ptr + size_t(j) * chunk_bytes, chunk_bytes, j, tag);
      receives_[s.index].push_back(std::move(pr));
    }
    api_->memcpy_async(into->ptr + size_t(r) * chunk_bytes, from->ptr + size_t(r) * chunk_bytes,
                       chunk_bytes, CopyKind::device_to_device, stream(s));
    return;
  }
  if (t) {
    std::vector<std::function<void()>> sends = std::move(device_sends_[s.index]);
    device_sends_[s.index].clear();
    t->group_start();
    for (auto& post : sends) post();
    for (int k = 1; k < p; ++k) {
      const int j = (r - k + p) % p;
      t->recv(*api_, stream(s), into->ptr + size_t(j) * chunk_bytes, chunk_bytes, j, tag);
    }
    for (int k = 1; k < p; ++k) {
      const int j = (r + k) % p;
      t->send(*api_, stream(s), from->ptr + size_t(j) * chunk_bytes, chunk_bytes, j, tag);
    }
    t->group_end();
    api_->memcpy_async(into->ptr + size_t(r) * chunk_bytes, from->ptr + size_t(r) * chunk_bytes,
                       chunk_bytes, CopyKind::device_to_device, stream(s));
    return;
  }
  for (int k = 1; k < p; ++k) {
    const int j = (r - k + p) % p;
    receives_[s.index].push_back(
        PendingReceive{comm.irecv(chunk_bytes, j, tag), into, size_t(j) * chunk_bytes, {}});
  }
  flush_device_sends(s);
  Buffer all = Buffer::uninitialized(size_t(p) * chunk_bytes);
  api_->memcpy_async(all.data(), from->ptr, size_t(p) * chunk_bytes, CopyKind::device_to_host,
                     stream(s));
  api_->memcpy_async(into->ptr + size_t(r) * chunk_bytes, from->ptr + size_t(r) * chunk_bytes,
                     chunk_bytes, CopyKind::device_to_device, stream(s));
  host_wait([&] { api_->stream_synchronize(stream(s)); });
  for (int k = 1; k < p; ++k) {
    const int j = (r + k) % p;
    Buffer out = Buffer::uninitialized(chunk_bytes);
    std::memcpy(out.data(), all.data() + size_t(j) * chunk_bytes, chunk_bytes);
    sends_.push_back(comm.isend(std::move(out), j, tag));
  }
}

void CudaDevice::barrier(Stream s, Communicator& comm) {
  flush_device_sends(s);
  flush_receives(s);
  host_wait([&] {
    api_->stream_synchronize(stream(s));
    comm.barrier();
  });
}

}  // namespace ctxpar::cuda
