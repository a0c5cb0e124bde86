// The cuda device (cuda_device.h): memory, order, staging of host memory, counters.
// Transfers are in cuda_transfers.cc, kernel operations in cuda_ops.cc.
#include "cuda/cuda_device.h"

#include <algorithm>
#include <cstring>
#include <exception>
#include <utility>

#include "ctxpar/error.h"
#include "device/devices.h"
#include "cuda/cuda_device_impl.h"

namespace ctxpar::cuda {

std::byte* CudaDevice::Storage::data() { return ptr; }

CudaDevice::CudaDevice(std::shared_ptr<CudaApi> api, int rank,
                       std::unique_ptr<CudnnAttention> cudnn, bool cudnn_required)
    : api_(std::move(api)), rank_(rank), cudnn_(std::move(cudnn)), cudnn_required_(cudnn_required) {
  for (auto& s : streams_) s = api_->stream_create();
  for (auto& e : free_events_) e = api_->event_create(false);
}

CudaDevice::~CudaDevice() {
  try {
    synchronize();
  } catch (...) {
    // Unwinding from a failure reported already; the memory goes with the streams below.
  }
  for (auto& q : receives_) {
    for (PendingReceive& r : q)
      if (r.complete) try {
          r.complete(false);
        } catch (...) {}
    q.clear();
  }
  for (auto& m : events_)
    for (auto& [seq, e] : m) destroy_event(e);
  for (auto& [a, b] : timings_) destroy_event(a), destroy_event(b);
  for (auto& e : free_events_) destroy_event(e);
  try {
    for (auto& s : streams_) api_->stream_synchronize(s);
  } catch (...) {}
  release_adopted();
  for (auto& s : streams_) try {
      api_->stream_destroy(s);
    } catch (...) {}
}

void CudaDevice::destroy_event(EventHandle e) noexcept {
  if (!e) return;
  try {
    api_->event_destroy(e);
  } catch (...) {  // cleanup: the error that matters was thrown already, or will be
  }
}

bool CudaDevice::adopt(void* p, size_t bytes) {
  if (!p || !bytes) return true;
  uintptr_t lo = reinterpret_cast<uintptr_t>(p), hi = lo + bytes;
  for (auto it = adopted_.begin(); it != adopted_.end();) {  // merge what it touches
    const uintptr_t a = reinterpret_cast<uintptr_t>((*it)->ptr), b = a + (*it)->size;
    if (a > hi || lo > b) {
      ++it;
      continue;
    }
    lo = std::min(lo, a), hi = std::max(hi, b);
    live_.erase(a);
    api_->release((*it)->ptr);
    it = adopted_.erase(it);
  }
  auto st = std::make_unique<Storage>();
  st->ptr = reinterpret_cast<std::byte*>(lo);
  st->size = hi - lo;
  for (bool& o : st->ordered) o = true;  // the caller's work on it is done (see the header)
  live_[lo] = st.get();
  api_->adopt(st->ptr, st->size);
  adopted_.push_back(std::move(st));
  return true;
}

void CudaDevice::release_adopted() {
  for (auto& st : adopted_) {
    live_.erase(reinterpret_cast<uintptr_t>(st->ptr));
    try {
      api_->release(st->ptr);
    } catch (...) {}
  }
  adopted_.clear();
}

// ---- memory -------------------------------------------------------------------------------

DeviceBuffer CudaDevice::alloc(size_t bytes) {
  auto st = std::make_unique<Storage>();
  Storage& s = *st;
  s.size = bytes;
  s.ptr = static_cast<std::byte*>(api_->malloc_async(bytes, stream(kComputeStream)));
  live_[reinterpret_cast<uintptr_t>(s.ptr)] = &s;
  DeviceBuffer b(this, std::move(st));  // from here a failure below frees it (free())
  s.alloc_event = api_->event_create(false);
  api_->event_record(s.alloc_event, stream(kComputeStream));
  s.ordered[kComputeStream.index] = true;
  return b;
}

DeviceBuffer CudaDevice::upload(const void* host, size_t bytes) {
  DeviceBuffer b = alloc(bytes);
  auto* st = static_cast<Storage*>(b.storage());
  if (bytes)
    api_->memcpy_async(st->ptr, host, bytes, CopyKind::host_to_device, stream(kComputeStream));
  api_->event_record(st->alloc_event, stream(kComputeStream));  // the upload is its birth
  return b;
}

void CudaDevice::free(std::unique_ptr<DeviceBuffer::Storage> storage) {
  auto* st = static_cast<Storage*>(storage.get());
  live_.erase(reinterpret_cast<uintptr_t>(st->ptr));
  for (auto& q : receives_)  // a receive into it is dropped: nothing may write it later
    for (PendingReceive& r : q)
      if (r.into == st) r.into = nullptr;
  try {
    flush_all_device_sends();  // a held send of this memory is enqueued before its free
    for (int i = 0; i < kStreams; ++i) {
      api_->event_record(free_events_[i], streams_[i]);
      api_->stream_wait_event(streams_[kStreams], free_events_[i]);
    }
    api_->free_async(st->ptr, streams_[kStreams]);
  } catch (...) {
    // free() never throws (device.h); a failed runtime reports at the next synchronize.
  }
  destroy_event(st->alloc_event);  // whatever failed above: it is never used again
}

CudaDevice::Storage* CudaDevice::storage_of(const void* p) const {
  const uintptr_t a = reinterpret_cast<uintptr_t>(p);
  auto it = live_.upper_bound(a);
  if (it == live_.begin()) return nullptr;
  --it;
  return a < it->first + std::max<size_t>(it->second->size, 1) ? it->second : nullptr;
}

void CudaDevice::before(Stream s, std::initializer_list<const void*> memory) {
  flush_device_sends(s);
  flush_receives(s);
  for (const void* p : memory) {
    Storage* st = p ? storage_of(p) : nullptr;
    if (!st || st->ordered[s.index]) continue;
    api_->stream_wait_event(stream(s), st->alloc_event);
    st->ordered[s.index] = true;
  }
}

// ---- order --------------------------------------------------------------------------------

Event CudaDevice::record(Stream s) {
  flush_device_sends(s);
  flush_receives(s);
  EventHandle e = api_->event_create(false);
  try {
    api_->event_record(e, stream(s));
  } catch (...) {
    destroy_event(e);
    throw;
  }
  const uint64_t seq = ++recorded_[s.index];
  events_[s.index][seq] = e;
  return Event{s.index, seq};
}

void CudaDevice::wait(Stream s, const Event& e) {
  if (e.stream < 0 || e.stream >= kStreams) return;
  auto it = events_[e.stream].find(e.seq);
  if (it == events_[e.stream].end()) return;  // synchronized since: done
  flush_device_sends(s);  // a send enqueued before this wait does not wait for e
  api_->stream_wait_event(stream(s), it->second);
}

void CudaDevice::host_wait(const std::function<void()>& f) {
  const double t0 = device::now_seconds();
  try {
    f();
  } catch (...) {
    counters_.wait_seconds += device::now_seconds() - t0;
    throw;
  }
  counters_.wait_seconds += device::now_seconds() - t0;
}

void CudaDevice::synchronize() {
  flush_all_device_sends();
  for (int i = 0; i < kStreams; ++i) flush_receives(Stream{i});
  host_wait([&] {
    for (auto& s : streams_) api_->stream_synchronize(s);
    std::vector<Request> sends = std::move(sends_);
    sends_.clear();
    for (Request& r : sends) r.wait();
  });
  // A device transport that aborted (nccl's watchdog) while the streams ran past its transfers
  // says so now, not at its next call.
  std::vector<std::pair<const void*, std::function<void()>>> checks = std::move(transport_checks_);
  transport_checks_.clear();
  for (auto& c : checks) c.second();
  keep_.clear();
  delta_out_.clear();
  // Each event leaves its container before it is destroyed, and every one is destroyed even
  // when reading a time fails: a pair destroyed here and left in timings_ would be read and
  // destroyed again (by the next synchronize or the destructor), and on a GPU that invalid
  // handle's error would stand in for the one thrown here first.
  std::exception_ptr failed;
  for (auto& [a, b] : std::exchange(timings_, {})) {
    try {
      if (!failed) counters_.busy_seconds += api_->event_elapsed_ms(a, b) / 1e3;
    } catch (...) {
      failed = std::current_exception();
    }
    destroy_event(a), destroy_event(b);
  }
  for (auto& m : events_)
    for (auto& [seq, e] : std::exchange(m, {})) destroy_event(e);
  if (failed) std::rethrow_exception(failed);
}

// ---- staging ------------------------------------------------------------------------------

Strided4 CudaDevice::strided(const TensorView& v) const {
  Strided4 r;
  r.ptr = static_cast<unsigned char*>(v.data());
  const int n = v.ndim();
  for (int i = 0; i < n; ++i) r.n[4 - n + i] = v.dim(i), r.s[4 - n + i] = v.stride(i);
  r.es = int64_t(dtype_size(v.dtype()));
  r.kind = v.dtype() == DType::f32 ? kF32 : v.dtype() == DType::bf16 ? kBf16 : kRaw;
  return r;
}

CudaDevice::Scope::Scope(CudaDevice& dev, Stream s) : dev_(dev), s_(s) {}
CudaDevice::Scope::~Scope() { temps_.clear(); }

void CudaDevice::Scope::finish() {
  for (auto it = back_.rbegin(); it != back_.rend(); ++it) (*it)();
  back_.clear();
}

std::byte* CudaDevice::Scope::scratch(size_t bytes) {
  temps_.push_back(dev_.alloc(bytes));
  return temps_.back().data();
}

// The bytes a view spans (non-negative strides).
static size_t extent_bytes(const TensorView& v) {
  int64_t last = 0;
  for (int i = 0; i < v.ndim(); ++i) {
    if (v.dim(i) == 0) return 0;
    CTXPAR_CHECK(v.stride(i) >= 0, "cuda device: a view with a negative stride");
    last += (v.dim(i) - 1) * v.stride(i);
  }
  return size_t(last + 1) * dtype_size(v.dtype());
}

TensorView CudaDevice::Scope::place(const TensorView& v, bool write) {
  if (v.empty() || dev_.on_device(v.data())) return v;
  const size_t bytes = extent_bytes(v);
  if (bytes == 0) return v;
  std::byte* d = scratch(bytes);
  CudaApi& api = *dev_.api_;
  const StreamHandle sh = dev_.stream(s_);
  dev_.before(s_, {d});
  // Written views are copied in too: the copy back writes the whole extent.
  api.memcpy_async(d, v.data(), bytes, CopyKind::host_to_device, sh);
  if (write) {
    void* host = v.data();
    back_.push_back([&api, sh, d, host, bytes] {
      api.memcpy_async(host, d, bytes, CopyKind::device_to_host, sh);
    });
  }
  return TensorView(d, v.dtype(), v.shape(), v.strides());
}

TensorView CudaDevice::Scope::rows(const TensorView& v, bool write) {
  const TensorView p = place(v, write);
  return p.empty() || p.ndim() < 1 || p.stride(p.ndim() - 1) == 1 ? p : contiguous(v, true, write);
}

TensorView CudaDevice::Scope::contiguous(const TensorView& v, bool read, bool write) {
  const TensorView p = place(v, write);
  if (p.empty() || p.contiguous()) return p;
  const size_t bytes = size_t(p.numel()) * dtype_size(p.dtype());
  std::byte* d = scratch(bytes);
  const TensorView c(d, p.dtype(), p.shape());
  CudaApi& api = *dev_.api_;
  const StreamHandle sh = dev_.stream(s_);
  dev_.before(s_, {d});
  if (read) api.copy(dev_.strided(p), dev_.strided(c), sh);
  if (write) {
    const Strided4 from = dev_.strided(c), to = dev_.strided(p);
    back_.push_back([&api, sh, from, to] { api.copy(from, to, sh); });
  }
  return c;
}

TensorView CudaDevice::Scope::widened(const TensorView& v) {
  const TensorView p = place(v, false);
  const TensorView w(scratch(size_t(v.numel()) * 4), DType::f32, v.shape());
  dev_.before(s_, {w.data()});
  if (v.numel()) dev_.api_->copy(dev_.strided(p), dev_.strided(w), dev_.stream(s_));
  return w;
}

// n items of `size` bytes at p, readable on the device: p itself, or a copy of host memory.
const void* CudaDevice::Scope::on_device(const void* p, int64_t n, size_t size) {
  if (n == 0 || dev_.on_device(p)) return p;
  std::byte* d = scratch(size_t(n) * size);
  dev_.before(s_, {d});
  dev_.api_->memcpy_async(d, p, size_t(n) * size, CopyKind::host_to_device, dev_.stream(s_));
  return d;
}

const int64_t* CudaDevice::Scope::positions(const Tokens& t, int64_t n) {
  CTXPAR_CHECK(int64_t(t.positions.size()) == n, "cuda device: ", t.positions.size(),
               " positions for ", n, " tokens");
  return static_cast<const int64_t*>(on_device(t.positions.data(), n, 8));
}

const int32_t* CudaDevice::Scope::documents(const Tokens& t, int64_t n, bool used) {
  if (!used) return nullptr;
  CTXPAR_CHECK(int64_t(t.documents.size()) == n, "cuda device: ", t.documents.size(),
               " document ids for ", n, " tokens (the mask uses documents)");
  return static_cast<const int32_t*>(on_device(t.documents.data(), n, 4));
}

const TileRange* CudaDevice::Scope::tiles(const int64_t* pos, const int32_t* doc, int64_t n,
                                          bool documents) {
  const int64_t count = (n + kTile - 1) / kTile;
  auto* out = reinterpret_cast<TileRange*>(
      scratch(size_t(std::max<int64_t>(count, 1)) * sizeof(TileRange)));
  dev_.before(s_, {pos, doc, out});
  if (n) dev_.api_->tile_ranges(pos, doc, n, documents, out, dev_.stream(s_));
  return out;
}

Tokens CudaDevice::host_tokens(Stream s, const Tokens& t, int64_t n, bool documents,
                               std::vector<int64_t>& pos, std::vector<int32_t>& docs) {
  const bool pos_dev = n && on_device(t.positions.data());
  const bool doc_dev = documents && n && on_device(t.documents.data());
  if (!pos_dev && !doc_dev) return t;
  Tokens h = t;
  before(s, {pos_dev ? t.positions.data() : nullptr, doc_dev ? t.documents.data() : nullptr});
  if (pos_dev) {
    pos.resize(size_t(n));
    api_->memcpy_async(pos.data(), t.positions.data(), size_t(n) * 8, CopyKind::device_to_host,
                       stream(s));
    h.positions = pos;
  }
  if (doc_dev) {
    docs.resize(size_t(n));
    api_->memcpy_async(docs.data(), t.documents.data(), size_t(n) * 4, CopyKind::device_to_host,
                       stream(s));
    h.documents = docs;
  }
  host_wait([&] { api_->stream_synchronize(stream(s)); });
  return h;
}

}  // namespace ctxpar::cuda
