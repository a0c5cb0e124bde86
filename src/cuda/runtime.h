// What the CUDA build is and what this machine has: for `ctxpar --version` and for the refusal
// of `--device cuda` where no GPU is found. Plain C++ (no CUDA header), so the command links it
// without compiling for CUDA.
#pragma once
#include <string>

namespace ctxpar::cuda {

// Lines of the form "CUDA: ...": nvcc version and architectures this build compiled for, the
// cuDNN and NCCL headers it was built against, and the cuDNN / NCCL libraries found now
// (dlopen of libcudnn.so.9, libnccl.so.2: cudnnGetVersion, ncclGetVersion) or why not.
std::string build_summary();

// cudaGetDeviceCount's answer.
struct DeviceProbe {
  int count = 0;
  int error = 0;           // cudaError_t; 0 = cudaSuccess
  std::string error_name;  // e.g. cudaErrorInsufficientDriver
  std::string error_text;  // e.g. "CUDA driver version is insufficient for CUDA runtime version"
  std::string first_name;  // cudaGetDeviceProperties(0).name when count > 0
  int first_sm = 0;        // its major * 10 + minor
};
DeviceProbe probe_devices();
// "no CUDA device found: cudaGetDeviceCount returned 35 (cudaErrorInsufficientDriver: ...);
// looked for: ..." -- one line, what was looked for and how to fix it.
std::string no_device_message(const DeviceProbe& probe);

}  // namespace ctxpar::cuda
