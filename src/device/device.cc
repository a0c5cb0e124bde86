// What every device shares: buffer and forward-state handles, names, make_device, and the
// ring's test-only hook. See docs/device.md.
#include "ctxpar/device.h"

#include <atomic>
#include <cstring>

#include "device/devices.h"

namespace ctxpar {

const char* stream_name(Stream s) {
  return s == kComputeStream ? "compute" : s == kCommStream ? "comm" : "?";
}

const char* device_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::cpu: return "cpu";
    case DeviceKind::sim: return "sim";
    case DeviceKind::cuda: return "cuda";
  }
  return "?";
}

DeviceKind parse_device(const std::string& name) {
  if (name == "cpu") return DeviceKind::cpu;
  if (name == "sim") return DeviceKind::sim;
  if (name == "cuda") return DeviceKind::cuda;
  throw Error("unknown device '" + name + "': use cpu, sim or cuda");
}

std::unique_ptr<Device> make_device(const DeviceOptions& options, int rank) {
  switch (options.kind) {
    case DeviceKind::cpu: return device::make_cpu();
    case DeviceKind::sim: return device::make_sim(options, rank);
    case DeviceKind::cuda:
      throw Error("device 'cuda': the CUDA device is not written yet (docs/cuda.md); use cpu or sim");
  }
  throw Error("unknown device kind");
}

DeviceBuffer::DeviceBuffer(Device* device, std::unique_ptr<Storage> storage)
    : device_(device), storage_(std::move(storage)) {
  device_->hold(storage_->size);
}
DeviceBuffer::DeviceBuffer(DeviceBuffer&& o) noexcept
    : device_(o.device_), storage_(std::move(o.storage_)) {}
DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    device_ = o.device_;
    storage_ = std::move(o.storage_);
  }
  return *this;
}
DeviceBuffer::~DeviceBuffer() { reset(); }

void DeviceBuffer::reset() {
  if (!storage_) return;
  device_->unhold(storage_->size);
  device_->free(std::move(storage_));
}

size_t DeviceBuffer::size() const { return storage_ ? storage_->size : 0; }
std::byte* DeviceBuffer::data() const { return storage_ ? storage_->data() : nullptr; }

TensorView DeviceBuffer::view(DType dtype, const Shape& shape, size_t offset) const {
  int64_t n = 1;
  for (int64_t s : shape) n *= s;
  CTXPAR_ASSERT(offset + size_t(n) * dtype_size(dtype) <= size(), "view past the buffer's end");
  return TensorView(data() + offset, dtype, shape);
}

DeviceBuffer Device::upload(const void* host, size_t bytes) {
  DeviceBuffer b = alloc(bytes);
  if (bytes) std::memcpy(b.data(), host, bytes);
  return b;
}

DeviceForwardState::DeviceForwardState(Device& device, int64_t batch, int64_t tq, int64_t hq,
                                       int64_t d)
    : device_(&device), state_(std::make_shared<ForwardState>(batch, tq, hq, d)) {
  device_->hold(state_->bytes());
}

DeviceForwardState::~DeviceForwardState() {
  if (!state_) return;
  device_->unhold(state_->bytes());
  device_->release_later(std::move(state_));
}

namespace {
std::atomic<bool> ring_skip_wait{false};
}
void set_ring_skip_wait_for_testing(bool skip) { ring_skip_wait = skip; }
bool ring_skip_wait_for_testing() { return ring_skip_wait; }

}  // namespace ctxpar
