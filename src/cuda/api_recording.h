// RecordingCudaApi: the CudaApi (api.h) on the host, for testing the cuda device without a GPU.
// "Device" memory is host memory it allocates; every operation runs at once, on the calling
// thread, through tile_math.cuh's functions (the very code kernels.cu runs per GPU thread), so
// results are those of the fallback kernel. Running at once is one of the orders a GPU may
// choose; what the GPU may do otherwise is checked on the log instead:
//   - streams and events carry vector clocks: an event's clock is its stream's at record, a
//     wait merges it into the waiting stream's, a host synchronisation into the host's (which
//     every later operation inherits);
//   - every operation names the memory it reads and writes (by the allocation that holds it);
//     an operation on stream s touching an allocation that another stream t wrote (or, for a
//     write, read) at a point s's clock does not cover is a violation, as is any use of an
//     allocation not yet ordered after its cudaMallocAsync, and a cudaFreeAsync whose stream
//     does not cover every use (the memory could be reused under a running kernel);
//   - adopted memory (the caller's, api.h's adopt / release) is ordered before every stream;
//     freeing it is a violation, and so is its release while a stream's use of it is not yet
//     synchronised with the host (the caller would read or reuse it under running work);
//   - freed memory is quarantined (kept, filled with 0xff: NaN in fp32 and bf16) and any later
//     use is a violation; live() lists what was never freed;
//   - events and streams are kept after their destroy (no handle is reused): a second destroy,
//     and a late one -- any use after the destroy -- are violations, as is reading the elapsed
//     time of an event never recorded (each an invalid-handle error on a GPU, which the next
//     checked call would report in place of the error that led there); live_events() and
//     live_streams() count what was never destroyed.
// Violations are collected (violations()), not thrown, so that a test sees all of them.
// fail_at() makes a chosen call throw, as a failing runtime call would: the device's error
// paths are tested with it.
#pragma once
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "cuda/api.h"

namespace ctxpar::cuda {

class RecordingCudaApi final : public CudaApi {
 public:
  struct Entry {
    std::string op;    // "malloc", "free", "memcpy h2d", "record", "wait", "forward", ...
    int stream = -1;   // the stream's id (creation order), -1 for host calls
    uint64_t seq = 0;  // the operation's number on its stream
    int event = -1;    // record / wait / synchronize: the event's id
    int event_stream = -1;
    uint64_t event_seq = 0;  // the stream point the event stands for
    const void* ptr = nullptr;
    size_t bytes = 0;
  };

  RecordingCudaApi();
  ~RecordingCudaApi() override;
  std::string name() const override { return "recording"; }

  StreamHandle stream_create() override;
  void stream_destroy(StreamHandle s) override;
  void stream_synchronize(StreamHandle s) override;
  void* native_stream(StreamHandle) override { return nullptr; }
  EventHandle event_create(bool timing) override;
  void event_destroy(EventHandle e) override;
  void event_record(EventHandle e, StreamHandle s) override;
  void stream_wait_event(StreamHandle s, EventHandle e) override;
  bool event_query(EventHandle e) override;
  void event_synchronize(EventHandle e) override;
  float event_elapsed_ms(EventHandle start, EventHandle end) override;

  void* malloc_async(size_t bytes, StreamHandle s) override;
  void free_async(void* p, StreamHandle s) override;
  void* host_alloc(size_t bytes) override;
  void host_free(void* p) override;
  void memcpy_async(void* dst, const void* src, size_t bytes, CopyKind kind,
                    StreamHandle s) override;
  void memset_async(void* p, int value, size_t bytes, StreamHandle s) override;
  void adopt(void* p, size_t bytes) override;
  void release(void* p) override;

  void tile_ranges(const int64_t* positions, const int32_t* documents, int64_t n,
                   bool documents_used, TileRange* out, StreamHandle s) override;
  void forward(const Problem<float>& p, const DeviceState& st, StreamHandle s) override;
  void forward(const Problem<Bf16>& p, const DeviceState& st, StreamHandle s) override;
  void finalize(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq, int64_t d, void* out,
                bool bf16, float* lse, StreamHandle s) override;
  void delta(const void* out, const void* dout, bool bf16, int64_t batch, int64_t tq, int64_t hq,
             int64_t d, float* delta, StreamHandle s) override;
  void backward(const Problem<float>& p, const BackwardRows& r, StreamHandle s) override;
  void backward(const Problem<Bf16>& p, const BackwardRows& r, StreamHandle s) override;
  void merge(float* o_a, float* lse_a, const float* o_b, const float* lse_b, int64_t batch,
             int64_t t, int64_t h, int64_t d, StreamHandle s) override;
  void permute(const std::byte* src, std::byte* dst, int64_t outer, int64_t src_tokens,
               int64_t dst_tokens, int64_t row, const int64_t* index, bool scatter,
               StreamHandle s) override;
  void copy(const Strided4& src, const Strided4& dst, StreamHandle s) override;
  void add(const Strided4& x, const Strided4& y, StreamHandle s) override;
  void zero(const Strided4& t, StreamHandle s) override;
  void fill_f32(float* p, int64_t n, float value, StreamHandle s) override;
  void absorb_partial(const DeviceState& st, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                      int64_t row0, int64_t rows, const float* o, const float* lse,
                      StreamHandle s) override;

  // The `nth` call (1 = the next) of `op` from now throws ctxpar::Error(`message`) before it
  // does anything; op is a log name ("forward", "malloc", "memcpy h2d", "record", "wait", ...)
  // or "stream_synchronize", "event_create", "elapsed".
  void fail_at(const std::string& op, int nth, const std::string& message);

  // What the log shows (thread-safe copies).
  std::vector<Entry> log() const;
  std::vector<std::string> violations() const;
  size_t live_events() const;  // created, never destroyed
  size_t live_streams() const;
  size_t live_allocations() const;  // device allocations not freed (adopted memory is not one)
  size_t adopted() const;           // adopted ranges not released
  size_t live_host_allocations() const;
  // Called by the destructor (tests: read the log of a device's API when the device goes).
  std::function<void(const RecordingCudaApi&)> on_destroy;
  // Whether p lies in a device allocation (live or freed) of this API.
  bool is_device_memory(const void* p) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  template <class T>
  void forward_t(const Problem<T>& p, const DeviceState& st, StreamHandle s);
  template <class T>
  void backward_t(const Problem<T>& p, const BackwardRows& r, StreamHandle s);
};

}  // namespace ctxpar::cuda
