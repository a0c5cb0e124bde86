// The CUDA build's description and the device probe (runtime.h), and the error of a failed
// CUDA call (cuda_check.h). cuDNN and NCCL are looked up with dlopen: the command has no link
// dependency on them, and says which it finds.
#include "cuda/runtime.h"

#include <cuda_runtime_api.h>
#include <dlfcn.h>

#include <cstdlib>
#include <string>

#include "core/environment.h"
#include "ctxpar/error.h"
#include "cuda/cuda_check.h"
#include "cuda/cudnn_use.h"

#ifndef CTXPAR_NVCC_VERSION
#error "runtime.cc is compiled by src/cuda/CMakeLists.txt, which defines the build's versions"
#endif

namespace ctxpar::cuda {

void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line) {
  throw Error(std::string("CUDA call ") + call + " failed at " + file + ":" + std::to_string(line) +
              ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")");
}

namespace {

std::string dotted(int major, int minor, int patch) {
  return std::to_string(major) + "." + std::to_string(minor) + "." + std::to_string(patch);
}

// The library `name` (by the loader's search, then in the toolkit's folder) and its version
// function, an `int f(void)` (size_t for cuDNN), called: "<version> (<the file loaded>)", or
// "not found (...)". The file is the one the loader chose (dladdr), so a first GPU run shows
// whether a pip wheel's copy or a system one was taken.
template <class Fn>
std::string library_version(const char* name, const char* symbol, Fn decode) {
  void* lib = dlopen(name, RTLD_NOW | RTLD_LOCAL);
  std::string where = name;
  if (!lib) {
    where = std::string(CTXPAR_CUDA_LIBDIR) + "/" + name;
    lib = dlopen(where.c_str(), RTLD_NOW | RTLD_LOCAL);
  }
  if (!lib) return std::string("not found (dlopen ") + name + ": " + dlerror() + ")";
  void* fn = dlsym(lib, symbol);
  Dl_info info{};
  if (fn && dladdr(fn, &info) && info.dli_fname) where = info.dli_fname;
  const std::string v = fn ? decode(fn) + " (" + where + ")" : std::string("no ") + symbol;
  dlclose(lib);
  return v;
}

}  // namespace

std::string build_summary() {
  const std::string cudnn = library_version("libcudnn.so.9", "cudnnGetVersion", [](void* f) {
    const int64_t v = int64_t(reinterpret_cast<size_t (*)()>(f)());  // 91900 = 9.19.0
    const std::string refusal = cudnn_version_refusal(v);
    return cudnn_version_name(v) + (refusal.empty() ? ", usable" : ", not usable: " + refusal);
  });
  const std::string nccl = library_version("libnccl.so.2", "ncclGetVersion", [](void* f) {
    int v = 0;
    reinterpret_cast<int (*)(int*)>(f)(&v);  // 22809 = 2.28.9
    return dotted(v / 10000, v / 100 % 100, v % 100);
  });
  int runtime = 0, driver = 0;
  cudaRuntimeGetVersion(&runtime);
  cudaDriverGetVersion(&driver);  // 0 where no driver is installed
  return std::string("CUDA: built with nvcc ") + CTXPAR_NVCC_VERSION + " for " + CTXPAR_CUDA_ARCHS +
         " (runtime " + std::to_string(runtime / 1000) + "." + std::to_string(runtime % 1000 / 10) +
         ", static); driver here: " +
         (driver ? std::to_string(driver / 1000) + "." + std::to_string(driver % 1000 / 10)
                 : std::string("none")) +
         "\nCUDA: cuDNN headers " + CTXPAR_CUDNN_HEADER + ", found here: " + cudnn +
         "\nCUDA: NCCL headers " + CTXPAR_NCCL_HEADER + ", found here: " + nccl + "\n";
}

DeviceProbe probe_devices() {
  DeviceProbe p;
  const cudaError_t err = cudaGetDeviceCount(&p.count);
  p.error = int(err);
  p.error_name = cudaGetErrorName(err);
  p.error_text = cudaGetErrorString(err);
  if (err != cudaSuccess) {
    p.count = 0;
    return p;
  }
  cudaDeviceProp prop{};
  if (p.count > 0 && cudaGetDeviceProperties(&prop, 0) == cudaSuccess) {
    p.first_name = prop.name;
    p.first_sm = prop.major * 10 + prop.minor;
  }
  return p;
}

std::string no_device_message(const DeviceProbe& p) {
  const std::optional<std::string> visible = environment::cuda().visible_devices;
  void* driver = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  const std::string driver_state = driver ? "loads" : "not found";
  if (driver) dlclose(driver);
  return "no CUDA device found: cudaGetDeviceCount returned " + std::to_string(p.error) + " (" +
         p.error_name + ": " + p.error_text + ") and " + std::to_string(p.count) +
         " devices; looked for NVIDIA GPUs through the driver library libcuda.so.1 (" +
         driver_state + "), CUDA_VISIBLE_DEVICES=" + visible.value_or("<unset>") +
         "; use --device cpu, or run on a machine with an NVIDIA GPU and its driver";
}

}  // namespace ctxpar::cuda
