// What the cuda device (cuda_device.h) uses of the CUDA runtime and of the fallback kernel's
// launchers, as one virtual interface mapped 1:1 onto them, so that the device is written once
// and runs over either implementation:
//   RealCudaApi (api_real.cc, built with CUDA only): the runtime (cudaStreamCreate,
//     cudaEventRecord, cudaMallocAsync, cudaMemcpyAsync, ...) and kernels.h's launchers.
//   RecordingCudaApi (api_recording.h, plain C++, built everywhere): host memory; every
//     operation runs at once on the host, through the same tile_math.cuh functions the GPU's
//     kernels call, and is written to a log (op, stream, the events each wait names, the
//     allocations and frees, the memory each op reads and writes), which checks the ordering
//     rules of device.h: what one stream reads of another's writes is ordered by a wait, and a
//     free comes after every use. This is how the device's bookkeeping is tested without a GPU.
// Plain C++: no CUDA header. Streams and events are opaque handles; native_stream() is the
// cudaStream_t (as void*) for a DeviceTransport, or nullptr where there is none (recording).
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

#include "cuda/tile_math.cuh"

// Whether the CUDA runtime's headers are here (the cuDNN path and the nccl transport need
// cudaStream_t); without them the device is built without those paths. CTXPAR_NO_CUDA_HEADERS
// builds as if they were missing (to check that build on a machine that has them).
#if !defined(CTXPAR_NO_CUDA_HEADERS) && __has_include(<cuda_runtime_api.h>)
#define CTXPAR_CUDA_HEADERS 1
#endif

namespace ctxpar::cuda {

struct StreamTag;
struct EventTag;
using StreamHandle = StreamTag*;
using EventHandle = EventTag*;

enum class CopyKind { host_to_device, device_to_host, device_to_device };

class CudaApi {
 public:
  virtual ~CudaApi() = default;
  virtual std::string name() const = 0;  // "cuda:<index> (<gpu name>)" or "recording"

  // ---- streams and events (cudaStreamCreate ... cudaEventElapsedTime) ----------------------
  virtual StreamHandle stream_create() = 0;
  virtual void stream_destroy(StreamHandle s) = 0;
  virtual void stream_synchronize(StreamHandle s) = 0;
  virtual void* native_stream(StreamHandle s) = 0;  // cudaStream_t, or nullptr
  virtual EventHandle event_create(bool timing) = 0;
  virtual void event_destroy(EventHandle e) = 0;
  virtual void event_record(EventHandle e, StreamHandle s) = 0;
  virtual void stream_wait_event(StreamHandle s, EventHandle e) = 0;
  virtual bool event_query(EventHandle e) = 0;  // true when done
  virtual void event_synchronize(EventHandle e) = 0;
  virtual float event_elapsed_ms(EventHandle start, EventHandle end) = 0;

  // ---- memory -------------------------------------------------------------------------------
  virtual void* malloc_async(size_t bytes, StreamHandle s) = 0;  // cudaMallocAsync
  virtual void free_async(void* p, StreamHandle s) = 0;          // cudaFreeAsync
  virtual void* host_alloc(size_t bytes) = 0;                    // cudaMallocHost (pinned)
  virtual void host_free(void* p) = 0;                           // cudaFreeHost
  virtual void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                            StreamHandle s) = 0;
  virtual void memset_async(void* p, int value, size_t bytes, StreamHandle s) = 0;
  // The caller's device memory (CudaDevice::adopt: a CUDA tensor handed in through DLPack),
  // used in place between adopt() and release(). No runtime call (RealCudaApi does nothing);
  // RecordingCudaApi tracks it as memory ordered before every stream, never freed, not a leak,
  // and checks at release() that the host has synchronised with every use of it.
  virtual void adopt(void* p, size_t bytes) {}
  virtual void release(void* p) {}

  // ---- the fallback kernel (kernels.h) ------------------------------------------------------
  virtual void tile_ranges(const int64_t* positions, const int32_t* documents, int64_t n,
                           bool documents_used, TileRange* out, StreamHandle s) = 0;
  virtual void forward(const Problem<float>& p, const DeviceState& st, StreamHandle s) = 0;
  virtual void forward(const Problem<Bf16>& p, const DeviceState& st, StreamHandle s) = 0;
  // out: [B, Tq, Hq, D] contiguous in fp32 (bf16 false) or bf16; lse [B, Hq, Tq].
  virtual void finalize(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                        void* out, bool bf16, float* lse, StreamHandle s) = 0;
  virtual void delta(const void* out, const void* dout, bool bf16, int64_t batch, int64_t tq,
                     int64_t hq, int64_t d, float* delta, StreamHandle s) = 0;
  virtual void backward(const Problem<float>& p, const BackwardRows& r, StreamHandle s) = 0;
  virtual void backward(const Problem<Bf16>& p, const BackwardRows& r, StreamHandle s) = 0;
  virtual void merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t batch,
                     int64_t t, int64_t h, int64_t d, StreamHandle s) = 0;
  // Token permutation (tile_math.cuh's permute_rows_byte).
  virtual void permute(const std::byte* src, std::byte* dst, int64_t outer, int64_t src_tokens,
                       int64_t dst_tokens, int64_t row, const int64_t* index, bool scatter,
                       StreamHandle s) = 0;
  // The small kernels of the device (tile_math.cuh): strided copy / cast, y += x, zero fill,
  // fill with one float (m = -inf), and a call's fp32 partial (o [B, rows, Hq, D] contiguous,
  // lse [B, Hq, rows]) absorbed into rows [row0, row0 + rows) of a state of tq rows.
  virtual void copy(const Strided4& src, const Strided4& dst, StreamHandle s) = 0;
  virtual void add(const Strided4& x, const Strided4& y, StreamHandle s) = 0;
  virtual void zero(const Strided4& t, StreamHandle s) = 0;
  virtual void fill_f32(float* p, int64_t n, float value, StreamHandle s) = 0;
  virtual void absorb_partial(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq,
                              int64_t d, int64_t row0, int64_t rows, const float* o,
                              const float* lse, StreamHandle s) = 0;
};

// RealCudaApi on CUDA device `index` (cudaSetDevice), or nullptr with `why` when this build
// has no CUDA or no device is found. Defined in api_real.cc (CUDA builds) or api_none.cc.
// (api_real.cc is compiled into ctxpar_cuda; api_none.cc into ctxpar_device without CUDA.)
std::unique_ptr<CudaApi> make_real_api(int index, std::string* why);
// How many CUDA devices this machine has; 0 with `why` saying why none (the command's message:
// cudaGetDeviceCount's error, the driver library, CUDA_VISIBLE_DEVICES), or that the build has
// no CUDA.
int device_count(std::string* why);
// One RealCudaApi per GPU and process, shared by the devices made on it (the loopback
// transport's ranks and their devices must share one GPU's); nullptr with `why` as above.
// cuda_factory.cc.
std::shared_ptr<CudaApi> shared_real_api(int index, std::string* why);

class CudnnAttention;
// cuDNN's fused attention for the devices over make_real_api (CudnnAttention::create, in
// cudnn_attention.cc) and the cudnnGetVersion() of the library it loaded, or nullptr with `why`
// (no libcudnn here, too old, no CUDA in this build): the device then runs every block on the
// fallback kernel. api_real.cc / api_none.cc.
std::unique_ptr<CudnnAttention> make_cudnn(std::string* why, int64_t* version = nullptr);
// make_cudnn as CTXPAR_CUDNN says (cudnn_use.h): nullptr under off or where make_cudnn finds
// none (said once per process), an Error under require; sets the process's cudnn_state().
// cuda_factory.cc.
std::unique_ptr<CudnnAttention> cudnn_of_mode();

}  // namespace ctxpar::cuda
