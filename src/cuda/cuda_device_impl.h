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

// The pair joins timings_ (read at synchronize) only once both are recorded: a pair whose
// operation failed is destroyed here, never read (an unrecorded event's elapsed time is an
// invalid-handle error on a GPU, which would replace the operation's own error).
template <class F>
void CudaDevice::timed(Stream s, F&& enqueue) {
  EventHandle a = api_->event_create(true), b = nullptr;
  try {
    b = api_->event_create(true);
    api_->event_record(a, stream(s));
    enqueue();
    api_->event_record(b, stream(s));
  } catch (...) {
    destroy_event(a);
    if (b) destroy_event(b);
    throw;
  }
  timings_.emplace_back(a, b);
}

}  // namespace ctxpar::cuda
