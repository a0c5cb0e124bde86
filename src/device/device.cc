// What every device shares: buffer and forward-state handles, names, the registry of device
// factories and make_device. See docs/device.md.
#include "ctxpar/device.h"

#include <cstring>

#include "ctxpar/error.h"
#include "device/devices.h"

namespace ctxpar {

const char* stream_name(Stream s) {
  return s == kComputeStream ? "compute" : s == kCommStream ? "comm" : "?";
}

const char* device_name(DeviceKind k) {
  switch (k) {
    case DeviceKind::cpu:
      return "cpu";
    case DeviceKind::sim:
      return "sim";
    case DeviceKind::cuda:
      return "cuda";
  }
  return "?";
}

DeviceKind parse_device(const std::string& name) {
  if (name == "cpu") return DeviceKind::cpu;
  if (name == "sim") return DeviceKind::sim;
  if (name == "cuda") return DeviceKind::cuda;
  throw Error("unknown device '" + name + "': use cpu, sim or cuda");
}

const std::shared_ptr<const DeviceRegistry>& DeviceRegistry::builtin() {
  static const std::shared_ptr<const DeviceRegistry> registry = [] {
    auto r = std::make_shared<DeviceRegistry>();
    r->factories_[int(DeviceKind::cpu)] = [](const DeviceOptions&, int) {
      return device::make_cpu();
    };
    r->factories_[int(DeviceKind::sim)] = device::make_sim;
    r->factories_[int(DeviceKind::cuda)] = device::make_cuda;
    return r;
  }();
  return registry;
}

std::shared_ptr<const DeviceRegistry> DeviceRegistry::with(DeviceKind kind,
                                                           DeviceFactory factory) const {
  auto r = std::make_shared<DeviceRegistry>(*this);
  r->factories_[int(kind)] = std::move(factory);
  return r;
}

std::unique_ptr<Device> DeviceRegistry::make(const DeviceOptions& options, int rank) const {
  const int kind = int(options.kind);
  CTXPAR_CHECK(kind >= 0 && kind < kDeviceKinds, "device kind ", kind, " is not a DeviceKind");
  CTXPAR_CHECK(factories_[kind], "this DeviceRegistry has no factory for device '",
               device_name(options.kind),
               "': give it one with with(DeviceKind::", device_name(options.kind),
               ", factory), or leave DeviceOptions::registry empty "
               "for the built-in devices");
  return factories_[kind](options, rank);
}

std::unique_ptr<Device> make_device(const DeviceOptions& options, int rank) {
  const DeviceRegistry& registry =
      options.registry ? *options.registry : *DeviceRegistry::builtin();
  return registry.make(options, rank);
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
                                       int64_t d, Stream s) {
  const Shape acc{batch, tq, hq, d}, rows{batch, hq, tq};
  const size_t acc_bytes = size_t(batch * tq * hq * d) * 4, row_bytes = size_t(batch * hq * tq) * 4;
  memory_ = device.alloc(acc_bytes + 2 * row_bytes);  // ForwardState::bytes()
  if (memory_.data()) {
    view_ =
        ForwardStateView(memory_.view(DType::f32, acc), memory_.view(DType::f32, rows, acc_bytes),
                         memory_.view(DType::f32, rows, acc_bytes + row_bytes));
  } else {
    // No elements (and no memory on cpu): views of nothing at an address that is never read or
    // written, as a ForwardState's empty tensors have one, so the kernel takes it as a state.
    static float nothing;
    view_ = ForwardStateView(TensorView(&nothing, DType::f32, acc),
                             TensorView(&nothing, DType::f32, rows),
                             TensorView(&nothing, DType::f32, rows));
  }
  device.forward_reset(s, view_);
}

void Device::forward_whole(Stream s, const TensorView& q, const Tokens& q_tokens,
                           const TensorView& k, const TensorView& v, const Tokens& k_tokens,
                           const Mask& mask, const TensorView& out, const TensorView& lse,
                           const KernelConfig& config) {
  if (caps().whole_forward) {
    run(s, {op::Forward{q, q_tokens, k, v, k_tokens, mask, out, lse, config}});
    return;
  }
  DeviceForwardState state(*this, q.dim(0), q.dim(1), q.dim(2), q.dim(3), s);
  forward_block(s, q, q_tokens, k, v, k_tokens, mask, state.get(), config);
  forward_finalize(s, state.get(), out, lse, config);
}

}  // namespace ctxpar
