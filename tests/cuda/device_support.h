// The cuda device's tests: a registry whose cuda devices are CudaDevices over RecordingCudaApi
// (optionally with the fake cuDNN), handed to strategies in their DeviceOptions, and what the
// devices' logs said when each went.
#pragma once
#include <atomic>
#include <cstdint>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "ctxpar/device.h"
#include "device/fused_calls.h"
#include "strategy/strategy_support.h"

namespace ctxpar::cuda {
class RecordingCudaApi;
}

namespace ctxpar::testing {

struct DeviceReport {
  std::vector<std::string> violations;       // ordering rules broken (RecordingCudaApi)
  size_t live = 0;                           // allocations never freed
  size_t live_events = 0, live_streams = 0;  // never destroyed
  size_t host_live = 0;
  size_t ops = 0;  // log entries
};

// How RecordingCudaDevices makes each device (beyond the recording API): the fake cuDNN, which
// graphs it refuses, CTXPAR_CUDNN=require, and a hook on each rank's API (fail_at).
struct RecordingSetup {
  bool fake_cudnn = false;
  std::function<bool(const fused::Call&, bool backward)> refuse;  // FakeCudnn's RefuseGraph
  bool cudnn_required = false;
  std::function<void(cuda::RecordingCudaApi&, int rank)> on_api;
};

// Recording CudaDevices: options() (kind cuda and a registry whose cuda devices these are)
// makes them wherever DeviceOptions go (StrategyOptions::device, make_device); reports() has
// one entry per device destroyed since. Outlives every device made from it.
class RecordingCudaDevices {
 public:
  explicit RecordingCudaDevices(bool fake_cudnn = false);
  explicit RecordingCudaDevices(const RecordingSetup& setup);
  DeviceOptions options() const;
  std::unique_ptr<Device> make(int rank) const { return make_device(options(), rank); }
  std::vector<DeviceReport> reports() const;
  int64_t cudnn_calls() const { return cudnn_calls_; }
  // "" when every device kept the rules and freed everything, else what went wrong.
  std::string problems() const;

 private:
  std::unique_ptr<Device> make_recording(int rank);
  RecordingSetup setup_;
  std::shared_ptr<const DeviceRegistry> registry_;
  mutable std::mutex mu_;
  std::vector<DeviceReport> reports_;
  std::atomic<int64_t> cudnn_calls_{0};
};

// "" when two runs' five outputs are bitwise equal, else the first that is not.
std::string bits_differ(const RunResult& a, const RunResult& b);

// "" when every error is within its bound, else the outputs that are not, with both values.
std::string beyond(const Errors& e, const Errors& bound);

}  // namespace ctxpar::testing
