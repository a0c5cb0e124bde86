// The built-in factory of cuda devices (DeviceRegistry::builtin()): a CudaDevice over the CUDA
// runtime on device LOCAL_RANK (when set) or rank % count; where there is no GPU (or no CUDA in
// this build), the refusal the command gives (tools/ctxpar/cuda_device.cc). Tests hand
// strategies a registry of their own whose cuda devices run over RecordingCudaApi.
#include <cstdlib>
#include <map>
#include <mutex>
#include <string>

#include "core/environment.h"
#include "ctxpar/error.h"
#include "cuda/api.h"
#include "cuda/cuda_device.h"
#include "cuda/cudnn_use.h"
#include "cuda/external.h"
#include "device/devices.h"

namespace ctxpar {
namespace device {

std::unique_ptr<Device> make_cuda(const DeviceOptions& options, int rank) {
  std::string why;
  const int count = cuda::device_count(&why);
  if (count <= 0) throw Error("device 'cuda': " + why);
  int index = rank % count;
  if (options.cuda_index >= 0) {
    if (options.cuda_index >= count)
      throw Error("device 'cuda': GPU " + std::to_string(options.cuda_index) +
                  " asked for, but this machine has " + std::to_string(count));
    index = options.cuda_index;
  } else if (const std::optional<std::string> given = environment::cuda().local_rank) {
    const char* local = given->c_str();
    char* end = nullptr;
    const long v = std::strtol(local, &end, 10);
    if (!*local || *end || v < 0 || v >= count)
      throw Error("LOCAL_RANK='" + *given + "': not a CUDA device index 0.." +
                  std::to_string(count - 1) + " on this machine; unset it or fix it");
    index = int(v);
  }
  std::shared_ptr<cuda::CudaApi> api = cuda::shared_real_api(index, &why);
  if (!api) throw Error("device 'cuda': " + why);
  return std::make_unique<cuda::CudaDevice>(std::move(api), rank, cuda::cudnn_of_mode(),
                                            cuda::cudnn_mode() == cuda::CudnnMode::require);
}

}  // namespace device

namespace cuda {
// cuDNN takes the bf16 blocks it supports; without it (no libcudnn.so.9 here, an old one, no
// GPU, CTXPAR_CUDNN=off) every block runs on the fallback kernel, which is exact, only slower:
// said once per process, and kept for --json (cudnn_state).
std::unique_ptr<CudnnAttention> cudnn_of_mode() {
  const CudnnMode mode = cudnn_mode();
  std::string why = "CTXPAR_CUDNN=off";
  std::unique_ptr<CudnnAttention> cudnn;
  int64_t version = 0;
  if (mode != CudnnMode::off) cudnn = make_cudnn(&why, &version);
  if (!cudnn && mode == CudnnMode::require)
    throw Error("device 'cuda': CTXPAR_CUDNN=require, but cuDNN cannot be used: " + why +
                "; unset CTXPAR_CUDNN to run on the fallback kernel");
  CudnnState state;
  if (cudnn)
    state.version = cudnn_version_name(version);
  else
    state.off_reason = why;
  set_cudnn_state(state);
  if (!cudnn)
    note_once("cudnn off", "cuDNN is off (" + why +
                               "): every attention block runs on the fallback kernel (exact, "
                               "slower)");
  return cudnn;
}

bool cudnn_report(Device& device, CudnnReport* out) {
  auto* cuda = dynamic_cast<CudaDevice*>(&device);
  if (!cuda) return false;
  out->cudnn_blocks = cuda->cudnn_blocks();
  out->cudnn_calls = cuda->cudnn_calls();
  out->fallback_blocks = cuda->fallback_blocks();
  out->refused_blocks = cuda->cudnn_refused();
  return true;
}

std::shared_ptr<CudaApi> shared_real_api(int index, std::string* why) {
  static std::mutex mu;
  static std::map<int, std::weak_ptr<CudaApi>> apis;
  std::lock_guard<std::mutex> lock(mu);
  if (std::shared_ptr<CudaApi> api = apis[index].lock()) return api;
  std::shared_ptr<CudaApi> api = make_real_api(index, why);
  if (api) apis[index] = api;
  return api;
}

}  // namespace cuda

}  // namespace ctxpar
