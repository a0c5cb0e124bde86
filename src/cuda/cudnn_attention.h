// cuDNN's fused attention (SDPA) for the fused calls of one (query block, K/V block) pair
// (src/device/fused_calls.h, masks as src/cuda/sdpa_mask.h), bf16 storage. Implemented in
// cudnn_attention.cc, the one translation unit that includes cudnn-frontend (its headers cost a
// minute of compile time each), with libcudnn loaded at run time so that one binary starts on
// machines without it. The cuda device (cuda_device.cc) sends each block pair it can express
// here (supports()), one call at a time, and everything else to the fallback kernel.
//
// Partial results are never merged in bf16: forward() writes the call's O and LSE as fp32 (when
// cuDNN gives bf16 O only, the fp32 copy of the bf16 O; docs/cuda.md says which tier that is),
// and the device merges them into the block's ForwardState in fp32. backward() writes the
// call's dQ, dK, dV as fp32 (same rule), which the device adds into its fp32 accumulators.
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "ctxpar/error.h"
#include "ctxpar/tensor.h"
#include "device/fused_calls.h"

namespace ctxpar::cuda {

// [B, T, H, D] in device memory: element strides of b, t, h (d is contiguous).
struct SdpaTensor {
  void* data = nullptr;
  int64_t b_stride = 0, t_stride = 0, h_stride = 0;
};
// [B, H, T] fp32 in device memory (LSE, cuDNN's stats): element strides of b, h, t.
struct SdpaRows {
  float* data = nullptr;
  int64_t b_stride = 0, h_stride = 0, t_stride = 0;
};

// The shape of a block pair; the calls cut rows [q_begin, q_end) and keys [k_begin, k_end)
// out of q (and dout, out) and k, v.
struct SdpaShape {
  DType dtype = DType::bf16;                  // storage of q, k, v, out, dout
  int64_t batch = 0, hq = 0, hkv = 0, d = 0;  // query head h reads kv head h / (hq / hkv)
  float scale = 0;
};

struct SdpaForward {
  SdpaTensor q, k, v;  // whole blocks, in shape.dtype
  SdpaTensor o;        // out: [B, call rows, Hq, D] fp32, rows from 0 (call-local)
  SdpaRows lse;        // out: [B, Hq, call rows] fp32, natural log, rows from 0
};

struct SdpaBackward {
  SdpaTensor q, k, v, out, dout;  // whole blocks, in shape.dtype; out = the final O of the rows
  SdpaRows lse;                   // the rows' final LSE (all K/V blocks), [B, Hq, Tq]
  SdpaTensor dq;                  // out: [B, call rows, Hq, D] fp32, call-local rows
  SdpaTensor dk, dv;              // out: [B, call keys, Hkv, D] fp32, call-local keys
};

// What prepare() built (tests/cuda/cudnn_attention_test.cc drives it device-less).
struct SdpaPrepared {
  size_t graph_id = 0;         // the cache entry: the same for the same key
  std::string key;             // the cache key, readable (the graph's shape in error messages)
  bool executable = false;     // plans built and loaded (never device-less)
  bool fp32_outputs = false;   // O / dQ / dK / dV requested as fp32 (else bf16)
  size_t workspace_bytes = 0;  // when executable
  size_t plans_stopped_at_module_load = 0;  // device-less: plans compiled, then no GPU to load
  std::string plan_build;                   // device-less: the plan build's message
};

// A graph cuDNN refuses to build (every output form refused at validation, heuristics,
// support check or plan build), by prepare(), workspace_bytes(), forward() or backward(),
// before anything is enqueued: the device runs that block on the fallback kernel, counted
// (CTXPAR_CUDNN=require makes it an error). Other cuDNN failures throw plain ctxpar::Error.
class CudnnRefused : public Error {
 public:
  using Error::Error;
};

class CudnnAttention {
 public:
  // nullptr, with `why` saying what was missing (libcudnn.so.9 not loadable, a version below
  // kMinCudnn of cudnn_use.h, no GPU for cudnnCreate), when cuDNN cannot be used here.
  static std::unique_ptr<CudnnAttention> create(std::string* why);
  // cudnnGetVersion() of the libcudnn.so.9 create() loaded (91700 = 9.17.0); 0 before or
  // without one.
  static int64_t loaded_version();
  // Device-less (tests): graphs for the device a cuDNN device-properties JSON describes (sm_90,
  // 132 SMs), built through the plan build's NVRTC compile, which ends at the module load
  // without a GPU; prepare() only (forward / backward / workspace_bytes throw).
  static std::unique_ptr<CudnnAttention> create_deviceless(const std::string& properties_json,
                                                           std::string* why);
  virtual ~CudnnAttention() = default;
  // Whether block pairs of this shape go to cuDNN (bf16 storage, d a multiple of 8 and
  // <= 256, hq a multiple of hkv); the device runs every other shape on the fallback kernel.
  virtual bool supports(const SdpaShape& shape) const = 0;
  // Scratch bytes forward() / backward() need for one call (the device allocates them): the
  // workspace of the call's graph with dense call-local strides (cuDNN sizes the SDPA
  // workspace by shape); forward() / backward() refuse a graph that needs more.
  virtual size_t workspace_bytes(const SdpaShape& shape, const fused::Call& call,
                                 bool backward) = 0;
  // Enqueue one call on `stream`. Graphs are built once per (shape, call rows, keys, mask form)
  // and cached; a cuDNN error throws ctxpar::Error naming the call (fused::Call::describe()).
  virtual void forward(const SdpaShape& shape, const fused::Call& call, const SdpaForward& t,
                       void* workspace, cudaStream_t stream) = 0;
  virtual void backward(const SdpaShape& shape, const fused::Call& call, const SdpaBackward& t,
                        void* workspace, cudaStream_t stream) = 0;
  // Builds (or finds in the cache) the graph forward() / backward() would run for these
  // tensors (their strides; data pointers unused), without executing it. Throws as they do.
  virtual SdpaPrepared prepare(const SdpaShape& shape, const fused::Call& call,
                               const SdpaForward& t) = 0;
  virtual SdpaPrepared prepare(const SdpaShape& shape, const fused::Call& call,
                               const SdpaBackward& t) = 0;
  // Graphs in the cache (each built once).
  virtual size_t graphs_built() const = 0;
};

}  // namespace ctxpar::cuda
