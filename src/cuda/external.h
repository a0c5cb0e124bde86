// What the Python package needs of the cuda device without its class (cuda_device.h): the
// caller's CUDA tensors used in place, and, for its tests only, devices over the recording
// API. Plain C++; defined in cuda_factory.cc, built into every ctxpar_device.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "ctxpar/device.h"

namespace ctxpar::cuda {

// CudaDevice::adopt on `device`: [p, p + bytes) is the caller's device memory, used in place
// until the device ends. False (and nothing done) when `device` is not a cuda device.
bool adopt(Device& device, void* p, size_t bytes);

// Where a cuda device's attention blocks went (--json's cudnn report): blocks run as cuDNN
// calls, the calls, blocks on the fallback kernel, and of those the ones cuDNN refused a graph
// of. False (out untouched) when `device` is not a cuda device. The process's cuDNN version or
// the reason it is off: cudnn_use.h's cudnn_state().
struct CudnnReport {
  int64_t cudnn_blocks = 0, cudnn_calls = 0, fallback_blocks = 0, refused_blocks = 0;
};
bool cudnn_report(Device& device, CudnnReport* out);

namespace testing {
// What a recording device's log showed when it ended (tests only).
struct RecordingReport {
  std::vector<std::string> violations;  // ordering rules broken, adopted memory misused
  size_t live = 0, host_live = 0;       // device / pinned allocations never freed
  size_t adopts = 0, releases = 0;      // the caller's ranges adopted and handed back
  size_t ops = 0;                       // log entries
};
// While on, make_device(cuda) makes CudaDevices over RecordingCudaApi (host memory stands for
// device memory: a "CUDA tensor" of a test is host memory labelled kDLCUDA); each one's
// report is kept when it ends. Off restores the real factory. Not thread-safe against
// devices being made at the same time.
void use_recording_devices(bool on);
std::vector<RecordingReport> take_recording_reports();
}  // namespace testing

}  // namespace ctxpar::cuda
