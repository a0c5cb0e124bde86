// load_nccl(): the real NcclApi -- libnccl.so.2 by dlopen, so that ctxpar starts (and every
// other transport works) on machines without NCCL; the CUDA runtime's events for the watchdog.
#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <mutex>
#include <string>

#include "core/environment.h"
#include "cuda/nccl_comm.h"

namespace ctxpar::cuda {
namespace {

// ncclConfig_t and ncclCommFinalize came with NCCL 2.14.
constexpr int kMinNcclVersion = 21400;

void cuda_check(cudaError_t e, const char* call) {
  if (e != cudaSuccess)
    throw Error(detail::concat("nccl transport: ", call, " failed: ", cudaGetErrorName(e), " (",
                               cudaGetErrorString(e), ")"));
}

template <typename Fn>
Fn* symbol(void* lib, const char* name, const std::string& path) {
  void* p = dlsym(lib, name);
  CTXPAR_CHECK(p != nullptr, "--transport nccl: ", path, " has no ", name,
               " (NCCL 2.14 or later is needed)");
  return reinterpret_cast<Fn*>(p);
}

std::shared_ptr<const NcclApi> load() {
  std::string path = environment::cuda().nccl_library.value_or("");
  if (path.empty()) path = "libnccl.so.2";
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (!lib) {
    const char* why = dlerror();
    throw Error(detail::concat("--transport nccl: cannot load ", path, " (", why ? why : "?",
                               "); install NCCL 2.x (libnccl2), put its folder on "
                               "LD_LIBRARY_PATH or set CTXPAR_NCCL_LIBRARY to the library's "
                               "path; or use another --transport"));
  }
  auto api = std::make_shared<NcclApi>();
  api->get_version = symbol<ncclResult_t(int*)>(lib, "ncclGetVersion", path);
  int version = 0;
  api->get_version(&version);
  CTXPAR_CHECK(version >= kMinNcclVersion, "--transport nccl: ", path, " is NCCL ", version,
               "; 2.14 (", kMinNcclVersion, ") or later is needed (non-blocking communicators)");
  api->get_unique_id = symbol<ncclResult_t(ncclUniqueId*)>(lib, "ncclGetUniqueId", path);
  api->comm_init_rank_config =
      symbol<ncclResult_t(ncclComm_t*, int, ncclUniqueId, int, ncclConfig_t*)>(
          lib, "ncclCommInitRankConfig", path);
  api->comm_get_async_error =
      symbol<ncclResult_t(ncclComm_t, ncclResult_t*)>(lib, "ncclCommGetAsyncError", path);
  api->comm_finalize = symbol<ncclResult_t(ncclComm_t)>(lib, "ncclCommFinalize", path);
  api->comm_destroy = symbol<ncclResult_t(ncclComm_t)>(lib, "ncclCommDestroy", path);
  api->comm_abort = symbol<ncclResult_t(ncclComm_t)>(lib, "ncclCommAbort", path);
  api->send =
      symbol<ncclResult_t(const void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)>(
          lib, "ncclSend", path);
  api->recv = symbol<ncclResult_t(void*, size_t, ncclDataType_t, int, ncclComm_t, cudaStream_t)>(
      lib, "ncclRecv", path);
  api->group_start = symbol<ncclResult_t()>(lib, "ncclGroupStart", path);
  api->group_end = symbol<ncclResult_t()>(lib, "ncclGroupEnd", path);
  api->get_error_string = symbol<const char*(ncclResult_t)>(lib, "ncclGetErrorString", path);
  api->get_last_error = symbol<const char*(ncclComm_t)>(lib, "ncclGetLastError", path);

  api->set_device = [](int device) { cuda_check(cudaSetDevice(device), "cudaSetDevice"); };
  api->mark = [](cudaStream_t stream) -> void* {
    cudaEvent_t e = nullptr;
    cuda_check(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreateWithFlags");
    const cudaError_t r = cudaEventRecord(e, stream);
    if (r != cudaSuccess) cudaEventDestroy(e);
    cuda_check(r, "cudaEventRecord");
    return e;
  };
  api->mark_done = [](void* mark) {
    const cudaError_t r = cudaEventQuery(static_cast<cudaEvent_t>(mark));
    return r == cudaSuccess ? 1 : r == cudaErrorNotReady ? 0 : -1;
  };
  api->mark_free = [](void* mark) { cudaEventDestroy(static_cast<cudaEvent_t>(mark)); };
  return api;  // the library stays loaded: NCCL's threads may outlive any one communicator
}

}  // namespace

std::shared_ptr<const NcclApi> load_nccl() {
  static std::mutex mutex;
  static std::shared_ptr<const NcclApi> api;
  std::lock_guard<std::mutex> lock(mutex);
  if (!api) api = load();
  return api;
}

std::unique_ptr<NcclCommunicator> nccl_over(Communicator& host, const NcclOptions& options) {
  return std::make_unique<NcclCommunicator>(host, load_nccl(), options);
}

}  // namespace ctxpar::cuda
