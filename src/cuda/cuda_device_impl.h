// Private to the cuda device's files (cuda_device.cc, cuda_ops.cc, cuda_transfers.cc): its
// storage record and the timing of attention operations.
#pragma once
#include "cuda/cuda_device.h"

namespace ctxpar::cuda {

struct CudaDevice::Storage final : DeviceBuffer::Storage {
  std::byte* ptr = nullptr;
  EventHandle alloc_event = nullptr;  // after the allocation (and an upload's copy)
  bool ordered[kStreams] = {};        // the stream waited for alloc_event already
  std::byte* data() override;
};

template <class F>
void CudaDevice::timed(Stream s, F&& enqueue) {
  EventHandle a = api_->event_create(true), b = api_->event_create(true);
  timings_.emplace_back(a, b);
  api_->event_record(a, stream(s));
  enqueue();
  api_->event_record(b, stream(s));
}

}  // namespace ctxpar::cuda
