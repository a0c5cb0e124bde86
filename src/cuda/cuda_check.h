// Every CUDA runtime call is checked where it is made (llm.c's cudaCheck, NCCL's NCCLCHECK):
// a failure throws ctxpar::Error naming the call, the file and line, and CUDA's error name and
// text, never a later symptom.
#pragma once
#include <cuda_runtime_api.h>

namespace ctxpar::cuda {

[[noreturn]] void throw_cuda_error(cudaError_t err, const char* call, const char* file, int line);

}  // namespace ctxpar::cuda

#define CTXPAR_CUDA_CHECK(call)                                                      \
  do {                                                                               \
    const cudaError_t ctxpar_cuda_err_ = (call);                                     \
    if (ctxpar_cuda_err_ != cudaSuccess)                                             \
      ::ctxpar::cuda::throw_cuda_error(ctxpar_cuda_err_, #call, __FILE__, __LINE__); \
  } while (0)
