// Private: the device factories, and the clock their counters use.
#pragma once
#include <chrono>
#include <functional>
#include <memory>

#include "ctxpar/clock.h"
#include "ctxpar/device.h"

namespace ctxpar::device {

using ctxpar::now_seconds;  // ctxpar/clock.h

std::unique_ptr<Device> make_cpu();
std::unique_ptr<Device> make_sim(const DeviceOptions& options, int rank);
// The cuda device (src/cuda/cuda_factory.cc): on this machine's GPU, or refused naming why.
std::unique_ptr<Device> make_cuda(const DeviceOptions& options, int rank);

namespace testing {
// Tests: make_device(cuda) calls `f` instead (e.g. CudaDevices over RecordingCudaApi); an empty
// function restores the GPU. Not a user-visible device name.
void set_cuda_factory(std::function<std::unique_ptr<Device>(int rank)> f);
}  // namespace testing

}  // namespace ctxpar::device
