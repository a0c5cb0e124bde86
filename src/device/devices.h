// Private: the built-in device factories (DeviceRegistry::builtin()), and the clock their
// counters use.
#pragma once
#include <chrono>
#include <memory>

#include "ctxpar/clock.h"
#include "ctxpar/device.h"

namespace ctxpar::device {

using ctxpar::now_seconds;  // ctxpar/clock.h

std::unique_ptr<Device> make_cpu();
std::unique_ptr<Device> make_sim(const DeviceOptions& options, int rank);
// The cuda device (src/cuda/cuda_factory.cc): on this machine's GPU, or refused naming why.
std::unique_ptr<Device> make_cuda(const DeviceOptions& options, int rank);

}  // namespace ctxpar::device
