// RealCudaApi (api.h): the CUDA runtime and kernels.h's launchers, one call each. Every
// runtime call is checked (cuda_check.h); a failure throws ctxpar::Error naming it.
#include <cuda_runtime_api.h>

#include "cuda/api.h"
#include "cuda/cuda_check.h"
#include "cuda/cudnn_attention.h"
#include "cuda/kernels.h"
#include "cuda/runtime.h"

namespace ctxpar::cuda {
namespace {

cudaStream_t cs(StreamHandle s) { return reinterpret_cast<cudaStream_t>(s); }
cudaEvent_t ce(EventHandle e) { return reinterpret_cast<cudaEvent_t>(e); }

class RealCudaApi final : public CudaApi {
 public:
  RealCudaApi(int index, std::string name) : index_(index), name_(std::move(name)) {}
  std::string name() const override { return name_; }

  StreamHandle stream_create() override {
    cudaStream_t s;
    CTXPAR_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    return reinterpret_cast<StreamHandle>(s);
  }
  void stream_destroy(StreamHandle s) override { cudaStreamDestroy(cs(s)); }
  void stream_synchronize(StreamHandle s) override {
    CTXPAR_CUDA_CHECK(cudaStreamSynchronize(cs(s)));
  }
  void* native_stream(StreamHandle s) override { return cs(s); }
  EventHandle event_create(bool timing) override {
    cudaEvent_t e;
    CTXPAR_CUDA_CHECK(
        cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
    return reinterpret_cast<EventHandle>(e);
  }
  void event_destroy(EventHandle e) override { cudaEventDestroy(ce(e)); }
  void event_record(EventHandle e, StreamHandle s) override {
    CTXPAR_CUDA_CHECK(cudaEventRecord(ce(e), cs(s)));
  }
  void stream_wait_event(StreamHandle s, EventHandle e) override {
    CTXPAR_CUDA_CHECK(cudaStreamWaitEvent(cs(s), ce(e), 0));
  }
  bool event_query(EventHandle e) override {
    const cudaError_t err = cudaEventQuery(ce(e));
    if (err == cudaErrorNotReady) return false;
    CTXPAR_CUDA_CHECK(err);
    return true;
  }
  void event_synchronize(EventHandle e) override { CTXPAR_CUDA_CHECK(cudaEventSynchronize(ce(e))); }
  float event_elapsed_ms(EventHandle a, EventHandle b) override {
    float ms = 0;
    CTXPAR_CUDA_CHECK(cudaEventElapsedTime(&ms, ce(a), ce(b)));
    return ms;
  }

  void* malloc_async(size_t bytes, StreamHandle s) override {
    void* p = nullptr;
    CTXPAR_CUDA_CHECK(cudaMallocAsync(&p, bytes ? bytes : 1, cs(s)));
    return p;
  }
  void free_async(void* p, StreamHandle s) override { CTXPAR_CUDA_CHECK(cudaFreeAsync(p, cs(s))); }
  void* host_alloc(size_t bytes) override {
    void* p = nullptr;
    CTXPAR_CUDA_CHECK(cudaMallocHost(&p, bytes ? bytes : 1));
    return p;
  }
  void host_free(void* p) override { cudaFreeHost(p); }
  void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle s) override {
    const cudaMemcpyKind k = kind == CopyKind::host_to_device   ? cudaMemcpyHostToDevice
                             : kind == CopyKind::device_to_host ? cudaMemcpyDeviceToHost
                                                                : cudaMemcpyDeviceToDevice;
    if (bytes) CTXPAR_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, k, cs(s)));
  }
  void memset_async(void* p, int value, size_t bytes, StreamHandle s) override {
    if (bytes) CTXPAR_CUDA_CHECK(cudaMemsetAsync(p, value, bytes, cs(s)));
  }

  void tile_ranges(const int64_t* pos, const int32_t* doc, int64_t n, bool documents,
                   TileRange* out, StreamHandle s) override {
    launch_tile_ranges(pos, doc, n, documents, out, cs(s));
  }
  void forward(const Problem<float>& p, const DeviceState& st, StreamHandle s) override {
    launch_forward(p, st, cs(s));
  }
  void forward(const Problem<Bf16>& p, const DeviceState& st, StreamHandle s) override {
    launch_forward(p, st, cs(s));
  }
  void finalize(const DeviceState& st, int64_t b, int64_t t, int64_t h, int64_t d, void* out,
                bool bf16, float* lse, StreamHandle s) override {
    if (bf16)
      launch_finalize(st, b, t, h, d, static_cast<Bf16*>(out), lse, cs(s));
    else
      launch_finalize(st, b, t, h, d, static_cast<float*>(out), lse, cs(s));
  }
  void delta(const void* out, const void* dout, bool bf16, int64_t b, int64_t t, int64_t h,
             int64_t d, float* delta, StreamHandle s) override {
    if (bf16)
      launch_delta(static_cast<const Bf16*>(out), static_cast<const Bf16*>(dout), b, t, h, d, delta,
                   cs(s));
    else
      launch_delta(static_cast<const float*>(out), static_cast<const float*>(dout), b, t, h, d,
                   delta, cs(s));
  }
  void backward(const Problem<float>& p, const BackwardRows& r, StreamHandle s) override {
    launch_backward(p, r, cs(s));
  }
  void backward(const Problem<Bf16>& p, const BackwardRows& r, StreamHandle s) override {
    launch_backward(p, r, cs(s));
  }
  void merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t b, int64_t t,
             int64_t h, int64_t d, StreamHandle s) override {
    launch_merge(o_a, lse_a, o_b, lse_b, b, t, h, d, cs(s));
  }
  void permute(const std::byte* src, std::byte* dst, int64_t outer, int64_t src_tokens,
               int64_t dst_tokens, int64_t row, const int64_t* index, bool scatter,
               StreamHandle s) override {
    launch_permute_rows(src, dst, outer, src_tokens, dst_tokens, row, index, scatter, cs(s));
  }
  void copy(const Strided4& src, const Strided4& dst, StreamHandle s) override {
    launch_strided(kStridedCopy, src, dst, cs(s));
  }
  void add(const Strided4& x, const Strided4& y, StreamHandle s) override {
    launch_strided(kStridedAdd, x, y, cs(s));
  }
  void zero(const Strided4& t, StreamHandle s) override {
    launch_strided(kStridedZero, t, t, cs(s));
  }
  void fill_f32(float* p, int64_t n, float value, StreamHandle s) override {
    launch_fill_f32(p, n, value, cs(s));
  }
  void absorb_partial(const DeviceState& st, int64_t b, int64_t tq, int64_t hq, int64_t d,
                      int64_t row0, int64_t rows, const float* o, const float* lse,
                      StreamHandle s) override {
    launch_absorb_partial(st, b, tq, hq, d, row0, rows, o, lse, cs(s));
  }

 private:
  int index_;
  std::string name_;
};

}  // namespace

int device_count(std::string* why) {
  const DeviceProbe p = probe_devices();
  if (p.count == 0 && why) *why = no_device_message(p);
  return p.count;
}

std::unique_ptr<CudaApi> make_real_api(int index, std::string* why) {
  const cudaError_t err = cudaSetDevice(index);
  if (err != cudaSuccess) {
    if (why)
      *why = "cudaSetDevice(" + std::to_string(index) + ") failed: " + cudaGetErrorName(err) +
             " (" + cudaGetErrorString(err) + ")";
    return nullptr;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, index);
  return std::make_unique<RealCudaApi>(index,
                                       "cuda:" + std::to_string(index) + " (" + prop.name + ")");
}

std::unique_ptr<CudnnAttention> make_cudnn(std::string* why, int64_t* version) {
  std::unique_ptr<CudnnAttention> cudnn = CudnnAttention::create(why);
  if (cudnn && version) *version = CudnnAttention::loaded_version();
  return cudnn;
}

}  // namespace ctxpar::cuda
