#include "cuda/device_support.h"

#include <cstring>

#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"
#ifdef CTXPAR_CUDA_HEADERS
#include "cuda/fake_cudnn.h"
#endif

namespace ctxpar::testing {

RecordingCudaDevices::RecordingCudaDevices(bool fake_cudnn)
    : RecordingCudaDevices(RecordingSetup{fake_cudnn, {}, false, {}}) {}

RecordingCudaDevices::RecordingCudaDevices(const RecordingSetup& setup)
    : setup_(setup),
      registry_(DeviceRegistry::builtin()->with(
          DeviceKind::cuda,
          [this](const DeviceOptions&, int rank) { return make_recording(rank); })) {}

DeviceOptions RecordingCudaDevices::options() const {
  DeviceOptions o;
  o.kind = DeviceKind::cuda;
  o.registry = registry_;
  return o;
}

std::unique_ptr<Device> RecordingCudaDevices::make_recording(int rank) {
  auto api = std::make_unique<cuda::RecordingCudaApi>();
  if (setup_.on_api) setup_.on_api(*api, rank);
  api->on_destroy = [this](const cuda::RecordingCudaApi& a) {
    DeviceReport r;
    r.violations = a.violations();
    r.live = a.live_allocations();
    r.live_events = a.live_events();
    r.live_streams = a.live_streams();
    r.host_live = a.live_host_allocations();
    r.ops = a.log().size();
    std::lock_guard<std::mutex> l(mu_);
    reports_.push_back(std::move(r));
  };
  std::unique_ptr<cuda::CudnnAttention> cudnn;
#ifdef CTXPAR_CUDA_HEADERS
  if (setup_.fake_cudnn) cudnn = std::make_unique<FakeCudnn>(&cudnn_calls_, setup_.refuse);
#endif
  return std::make_unique<cuda::CudaDevice>(std::move(api), rank, std::move(cudnn),
                                            setup_.cudnn_required);
}

std::vector<DeviceReport> RecordingCudaDevices::reports() const {
  std::lock_guard<std::mutex> l(mu_);
  return reports_;
}

std::string RecordingCudaDevices::problems() const {
  std::string out;
  for (const DeviceReport& r : reports()) {
    for (const std::string& v : r.violations) out += v + "\n";
    if (r.live) out += std::to_string(r.live) + " device allocations never freed\n";
    if (r.live_events) out += std::to_string(r.live_events) + " events never destroyed\n";
    if (r.live_streams) out += std::to_string(r.live_streams) + " streams never destroyed\n";
    if (r.host_live) out += std::to_string(r.host_live) + " pinned host allocations never freed\n";
  }
  return out;
}

std::string bits_differ(const RunResult& a, const RunResult& b) {
  const char* names[] = {"o", "lse", "dq", "dk", "dv"};
  const Tensor* x[] = {&a.o, &a.lse, &a.dq, &a.dk, &a.dv};
  const Tensor* y[] = {&b.o, &b.lse, &b.dq, &b.dk, &b.dv};
  for (int i = 0; i < 5; ++i)
    if (x[i]->bytes() != y[i]->bytes() ||
        std::memcmp(x[i]->data(), y[i]->data(), x[i]->bytes()) != 0)
      return names[i];
  return "";
}

std::string beyond(const Errors& e, const Errors& bound) {
  std::string out;
  const char* names[] = {"o", "lse", "dq", "dk", "dv"};
  const double got[] = {e.o, e.lse, e.dq, e.dk, e.dv};
  const double max[] = {bound.o, bound.lse, bound.dq, bound.dk, bound.dv};
  for (int i = 0; i < 5; ++i)
    if (!(got[i] <= max[i]))
      out += std::string(names[i]) + " " + std::to_string(got[i]) + " > " + std::to_string(max[i]) +
             "; ";
  return out;
}

}  // namespace ctxpar::testing
