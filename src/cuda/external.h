// What the command needs of the cuda device without its class (cuda_device.h): where its
// attention blocks went. Plain C++; defined in cuda_factory.cc, built into every ctxpar_device.
#pragma once
#include <cstdint>

#include "ctxpar/device.h"

namespace ctxpar::cuda {

// Where a cuda device's attention blocks went (--json's cudnn report): blocks run as cuDNN
// calls, the calls, blocks on the fallback kernel, and of those the ones cuDNN refused a graph
// of. False (out untouched) when `device` is not a cuda device. The process's cuDNN version or
// the reason it is off: cudnn_use.h's cudnn_state().
struct CudnnReport {
  int64_t cudnn_blocks = 0, cudnn_calls = 0, fallback_blocks = 0, refused_blocks = 0;
};
bool cudnn_report(Device& device, CudnnReport* out);

}  // namespace ctxpar::cuda
