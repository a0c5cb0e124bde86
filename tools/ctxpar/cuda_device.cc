// --device cuda and the CUDA lines of --version (docs/cuda.md). Where there is no GPU (with
// cudaGetDeviceCount's error) or the build has no CUDA, the command says so and exits 2 before
// anything runs; on a GPU it goes on, and make_device builds the cuda device (src/cuda).
#include <string>

#include "ctxpar/error.h"
#include "options.h"
#ifdef CTXPAR_HAVE_CUDA
#include "cuda/runtime.h"
#endif

namespace ctxpar::cli {

void check_cuda_device() {
#ifdef CTXPAR_HAVE_CUDA
  const cuda::DeviceProbe p = cuda::probe_devices();
  if (p.count == 0) throw Error("--device cuda: " + cuda::no_device_message(p));
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
