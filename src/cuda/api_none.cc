// make_real_api / device_count in a build without CUDA (CTXPAR_CUDA=OFF or no nvcc): there is
// no runtime to call, so the cuda device is refused with the command's reason.
#include "cuda/api.h"
#include "cuda/cuda_device.h"  // CudnnAttention (complete, with or without the CUDA headers)

namespace ctxpar::cuda {

int device_count(std::string* why) {
  if (why)
    *why =
        "this ctxpar was built without CUDA (CTXPAR_CUDA=OFF, or no nvcc at configure time); "
        "rebuild with -DCTXPAR_CUDA=ON where the CUDA toolkit is installed, or use cpu";
  return 0;
}

std::unique_ptr<CudaApi> make_real_api(int, std::string* why) {
  device_count(why);
  return nullptr;
}

std::unique_ptr<CudnnAttention> make_cudnn(std::string* why, int64_t*) {
  device_count(why);
  return nullptr;
}

}  // namespace ctxpar::cuda
