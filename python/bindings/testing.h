// The extension's test hooks, compiled only into a test build (CMake CTXPAR_PYTHON_TESTING=ON,
// which scripts/test.sh installs; the package `pip install .` builds has none): cuda devices
// over the recording CUDA API (host memory standing for device memory, the fallback kernel's
// tile math, a checked log), for the tests of the CUDA-tensor path on a machine without a GPU.
#pragma once
#include <memory>

#include "arrays.h"
#include "ctxpar/device.h"

namespace ctxpar::python::testing {

// The registry whose cuda devices run over RecordingCudaApi while a test has turned them on
// (_testing_cuda_recording(True)), else null: the built-in devices.
std::shared_ptr<const DeviceRegistry> device_registry();
// _testing_cuda_recording(on) and _testing_cuda_reports().
void bind(nb::module_& m);

}  // namespace ctxpar::python::testing
