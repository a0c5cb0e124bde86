// --device cuda and the CUDA lines of --version (docs/cuda.md). The CUDA device class is not
// written yet: the command says what it finds -- no GPU (with cudaGetDeviceCount's error), a
// GPU it cannot use yet, or a build without CUDA -- and exits 2 before anything runs.
#include <string>

#include "ctxpar/error.h"
#include "options.h"
#ifdef CTXPAR_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ctxpar::cli {

void refuse_cuda_device() {
#ifdef CTXPAR_HAVE_CUDA
  const cuda::DeviceProbe p = cuda::probe_devices();
  if (p.count == 0) throw Error("--device cuda: " + cuda::no_device_message(p));
  throw Error("--device cuda: found " + std::to_string(p.count) + " CUDA device(s) (first: " +
              p.first_name + ", sm_" + std::to_string(p.first_sm) +
              "), but ctxpar's cuda device is not written yet (docs/cuda.md); use --device cpu");
#else
  throw Error("--device cuda: this ctxpar was built without CUDA (CTXPAR_CUDA=OFF, or no nvcc "
              "at configure time); rebuild with -DCTXPAR_CUDA=ON where the CUDA toolkit is "
              "installed, or use --device cpu");
#endif
}

std::string cuda_version_lines() {
#ifdef CTXPAR_HAVE_CUDA
  return cuda::build_summary();
#else
  return "CUDA: not built (CTXPAR_CUDA=OFF, or no nvcc at configure time)\n";
#endif
}

}  // namespace ctxpar::cli
