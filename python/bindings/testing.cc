// The extension's test hooks (testing.h): a registry of recording cuda devices, each of which
// leaves a report of its log when it ends.
#include "testing.h"

#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "cuda/api_recording.h"
#include "cuda/cuda_device.h"

namespace ctxpar::python::testing {
namespace {

// What a recording device's log showed when it ended.
struct Report {
  std::vector<std::string> violations;  // ordering rules broken, adopted memory misused
  size_t live = 0, host_live = 0;       // device / pinned allocations never freed
  size_t adopts = 0, releases = 0;      // the caller's ranges adopted and handed back
  size_t ops = 0;                       // log entries
};

std::mutex mu;  // guards both below: devices end on their ranks' threads
std::shared_ptr<const DeviceRegistry> recording;
std::vector<Report> reports;

std::unique_ptr<Device> make_recording(const DeviceOptions&, int rank) {
  auto api = std::make_unique<cuda::RecordingCudaApi>();
  api->on_destroy = [](const cuda::RecordingCudaApi& a) {
    Report r;
    r.violations = a.violations();
    r.live = a.live_allocations();
    r.host_live = a.live_host_allocations();
    const auto log = a.log();
    r.ops = log.size();
    for (const auto& e : log) r.adopts += e.op == "adopt", r.releases += e.op == "release";
    std::lock_guard<std::mutex> l(mu);
    reports.push_back(std::move(r));
  };
  return std::make_unique<cuda::CudaDevice>(std::move(api), rank);
}

void set_recording(bool on) {
  std::lock_guard<std::mutex> l(mu);
  recording = on ? DeviceRegistry::builtin()->with(DeviceKind::cuda, make_recording) : nullptr;
}

nb::list take_reports() {
  std::vector<Report> taken;
  {
    std::lock_guard<std::mutex> l(mu);
    taken = std::exchange(reports, {});
  }
  nb::list out;
  for (const Report& r : taken) {
    nb::dict d;
    d["violations"] = r.violations;
    d["live"] = r.live, d["host_live"] = r.host_live;
    d["adopts"] = r.adopts, d["releases"] = r.releases, d["ops"] = r.ops;
    out.append(d);
  }
  return out;
}

}  // namespace

std::shared_ptr<const DeviceRegistry> device_registry() {
  std::lock_guard<std::mutex> l(mu);
  return recording;
}

void bind(nb::module_& m) {
  m.def("_testing_cuda_recording", &set_recording, nb::arg("on"),
        "Test builds only: cuda devices over the recording CUDA API (host memory), on or off.");
  m.def("_testing_cuda_reports", &take_reports,
        "Test builds only: the logs' verdicts of the recording cuda devices ended since the "
        "last call.");
}

}  // namespace ctxpar::python::testing
