// The `cuda` device (device.h's contract on a GPU), written against CudaApi (api.h) only, so
// that the same code runs over the CUDA runtime (RealCudaApi) and, for tests without a GPU,
// over RecordingCudaApi (host memory, the same tile math, a log of every stream operation).
// docs/cuda.md says what has been checked where.
//
//   Streams: compute and comm (device.h's two), plus a third of its own that frees memory.
//   Memory: cudaMallocAsync on the compute stream; a buffer first used on the comm stream makes
//     it wait once for the allocation's event. free() records an event on both streams, makes
//     the free stream wait for both, and frees there: the memory goes once every operation
//     enqueued so far is done, without ordering compute after comm. The device knows its own
//     allocations: a view or a Tokens span outside them is host memory (the caller's tensors),
//     staged through a temporary device buffer (copied in; copied back after a write).
//   Kernels: the fallback kernel (kernels.h) for every block; bf16 blocks of a shape cuDNN
//     supports go to a CudnnAttention (injectable), one fused call at a time (fused_calls.h),
//     their fp32 partials merged into the state / added into the gradients.
//   Transfers: through the communicator's DeviceTransport where it has one (device_transport.h:
//     nccl on the stream's cudaStream_t, grouped; loopback at once); otherwise staged through host memory: a send copies the buffer to
//     the host once the stream's earlier work is done (the host waits for it) and posts
//     comm.isend; a receive posts comm.irecv at once and, before the next operation of its
//     stream, waits for the message (the communicator's timeout names the peer) and copies it
//     to the device on the stream.
//   Counters: flops as kernel.h counts them (from the block's tile ranges), busy_seconds from
//     event pairs around the attention operations (read at synchronize), wait_seconds the
//     host's blocking time.
#pragma once
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/device.h"
#include "cuda/api.h"

#ifdef CTXPAR_CUDA_HEADERS
#include "cuda/cudnn_attention.h"
#else
namespace ctxpar::cuda {
// Without the CUDA headers there is no cuDNN path: a CudnnAttention is never made.
class CudnnAttention {
 public:
  virtual ~CudnnAttention() = default;
};
}  // namespace ctxpar::cuda
#endif
namespace ctxpar::cuda {

class CudaDevice final : public Device {
 public:
  // `cudnn` may be null: every block then runs on the fallback kernel.
  // `api` may be shared: the loopback transport's ranks share one GPU's (loopback.h).
  // `cudnn_required` (CTXPAR_CUDNN=require): a graph cuDNN refuses is an error, not a fallback.
  CudaDevice(std::shared_ptr<CudaApi> api, int rank, std::unique_ptr<CudnnAttention> cudnn = {},
             bool cudnn_required = false);
  ~CudaDevice() override;
  std::string name() const override { return "cuda"; }
  CudaApi& api() { return *api_; }
  bool has_cudnn() const { return cudnn_ != nullptr; }
  // Where the attention blocks went (--json's cudnn report): blocks run as cuDNN calls, the
  // calls, blocks run on the fallback kernel, and of those the ones cuDNN refused a graph of.
  int64_t cudnn_blocks() const { return cudnn_blocks_; }
  int64_t cudnn_calls() const { return cudnn_calls_; }
  int64_t fallback_blocks() const { return fallback_blocks_; }
  int64_t cudnn_refused() const { return cudnn_refused_; }

  // The caller's device memory [p, p + bytes) (a CUDA tensor handed in through DLPack), used
  // in place until the device ends: views inside it are neither staged nor ever freed by the
  // device. Ranges that overlap or touch are merged. Order with the caller's own work is the
  // caller's: finish it before the first operation (the Python package synchronizes torch's
  // current stream), and read the results after synchronize() (which every Strategy forward
  // and backward ends with). docs/python.md, "CUDA tensors".
  bool adopt(void* p, size_t bytes) override;

  DeviceBuffer alloc(size_t bytes) override;
  DeviceBuffer upload(const void* host, size_t bytes) override;
  Event record(Stream s) override;
  void wait(Stream s, const Event& e) override;
  void synchronize() override;

  void send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) override;
  DeviceBuffer recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) override;
  void alltoall(Stream s, Communicator& comm, const DeviceBuffer& send, const DeviceBuffer& recv,
                size_t chunk_bytes, int tag) override;
  void barrier(Stream s, Communicator& comm) override;
  bool lends_sent_buffers(const Communicator&) const override { return false; }
  bool host_readable(const void* p) const override { return !on_device(p); }
  // Its kernels do not check finiteness, and nothing reads the inputs on the host to do it.
  DeviceCaps caps() const override { return {.finite_checks = false}; }

  void run(Stream s, const Op& op) override;

 protected:
  void free(std::unique_ptr<DeviceBuffer::Storage> storage) override;

 private:
  struct Storage;
  // One operation's temporaries: device copies of host views and contiguous copies, with what
  // has to be copied back once the operation is enqueued (in reverse order), then freed.
  class Scope {
   public:
    Scope(CudaDevice& dev, Stream s);
    ~Scope();  // frees the temporaries (stream-ordered); never throws
    // v with a contiguous last dim (View4's need), placed as below.
    TensorView rows(const TensorView& v, bool write);
    // v where a kernel can read (and, with `write`, write) it: v itself when it is device
    // memory, else a device copy of its extent (copied back after the operation).
    TensorView place(const TensorView& v, bool write);
    // The same, contiguous (copied through the strided copy kernel where v is not).
    TensorView contiguous(const TensorView& v, bool read, bool write);
    // A contiguous fp32 device copy of v (bf16 widens exactly).
    TensorView widened(const TensorView& v);
    // A contiguous device buffer of `bytes` for this operation only.
    std::byte* scratch(size_t bytes);
    const void* on_device(const void* p, int64_t n, size_t size);
    // Token positions / documents readable on the device.
    const int64_t* positions(const Tokens& t, int64_t n);
    const int32_t* documents(const Tokens& t, int64_t n, bool used);
    // Tile ranges of n tokens (positions / documents on the device), computed on the device.
    const TileRange* tiles(const int64_t* pos, const int32_t* doc, int64_t n, bool documents);
    void finish();  // enqueue the copies back
    Stream stream() const { return s_; }

   private:
    CudaDevice& dev_;
    Stream s_;
    std::vector<DeviceBuffer> temps_;
    std::vector<std::function<void()>> back_;
  };

  // One specialisation per operation of device_op.h (cuda_ops.cc), for run(): its
  // arguments checked, staged and launched.
  template <class Args>
  void enqueue(Stream s, const Args& a);

  StreamHandle stream(Stream s) const { return streams_[s.index]; }
  Storage* storage_of(const void* p) const;  // the live allocation holding p, or null
  bool on_device(const void* p) const { return storage_of(p) != nullptr; }
  // Orders stream s after the allocations of the memory it is about to touch, and completes
  // pending receives of s first (device.h: operations of one stream run in order).
  void before(Stream s, std::initializer_list<const void*> memory);
  // Completes s's pending receives (all, or those up to the last one into `only`).
  void flush_receives(Stream s, const Storage* only = nullptr);
  void flush_receives_front(Stream s);
  // Orders a transfer of st on s: after st's allocation and the receives into st before it.
  void order_transfer(Stream s, Storage* st);
  // Tokens on the host (a copy read back when they are device memory; blocks the host).
  Tokens host_tokens(Stream s, const Tokens& t, int64_t n, bool documents,
                     std::vector<int64_t>& pos, std::vector<int32_t>& docs);
  struct HostBlock {
    std::vector<int64_t> qp, kp;
    std::vector<int32_t> qd, kd;
    Tokens q, k;
  };
  // A block's tokens on the host (read back where they are device memory), and its FLOPs
  // counted as kernel.h counts them (factor 1 forward, 2.5 backward).
  void host_block(Stream s, const TensorView& q, const Tokens& qt, const TensorView& k,
                  const Tokens& kt, const Mask& mask, double factor, HostBlock& hb);
  template <class F>
  void timed(Stream s, F&& enqueue);           // an attention operation between two timing events
  void destroy_event(EventHandle e) noexcept;  // cleanup: never throws
  void host_wait(const std::function<void()>& f);  // counts wait_seconds
  Strided4 strided(const TensorView& v) const;
  template <class T>
  Problem<T> problem(Scope& sc, const TensorView& q, const Tokens& qt, const TensorView& k,
                     const TensorView& v, const Tokens& kt, const Mask& mask, float scale);
  template <class T>
  void forward_fallback(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                        const TensorView& k, const TensorView& v, const Tokens& kt,
                        const Mask& mask, const DeviceState& st, float scale);
  template <class T>
  void backward_fallback(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                         const TensorView& k, const TensorView& v, const Tokens& kt,
                         const Mask& mask, const TensorView& dout, const BackwardRows& rows,
                         float scale);
#ifdef CTXPAR_CUDA_HEADERS
  bool cudnn_refused(const CudnnRefused& r);  // false (a fallback, counted), or throws
#endif
  bool cudnn_forward(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                     const TensorView& k, const TensorView& v, const Tokens& kt, const Mask& mask,
                     const DeviceState& st, float scale);
  bool cudnn_backward(Stream s, Scope& sc, const TensorView& q, const Tokens& qt,
                      const TensorView& k, const TensorView& v, const Tokens& kt, const Mask& mask,
                      const TensorView& dout, const TensorView& lse, const TensorView& delta,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      float scale);
  // backward_delta's O (a device copy: the caller may free its own) by the address of the
  // delta it wrote, for cuDNN's backward, which takes O; dropped at synchronize().
  std::map<const void*, std::pair<DeviceBuffer, TensorView>> delta_out_;
  void elementwise(Stream s, const TensorView& x, const TensorView& y,
                   void (CudaApi::*op)(const Strided4&, const Strided4&, StreamHandle));
  void permute(Stream s, const TensorView& src, const TensorView& dst, const TensorView& index,
               bool scatter);

  // Sends and receives through a grouped DeviceTransport (nccl) are held until the next other
  // operation on their stream (or a free, or synchronize), which first posts them all as one
  // group (DeviceTransport::group_start / end), as NCCL needs: a ring step's receive and send
  // then progress together. Posted one by one, each rank's first transfer would wait for a
  // peer whose matching transfer is queued behind its own first one, and a ring deadlocks.
  std::vector<std::function<void()>> device_sends_[kStreams];
  void flush_device_sends(Stream s);
  void flush_all_device_sends() {
    for (int i = 0; i < kStreams; ++i) flush_device_sends(Stream{i});
  }
  // DeviceTransport::check() of each transport used since the last synchronize().
  std::vector<std::pair<const void*, std::function<void()>>> transport_checks_;

  struct PendingReceive {
    Request request;
    Storage* into = nullptr;  // null once the buffer was freed
    size_t offset = 0;
    std::function<void(bool)> complete;  // an immediate DeviceTransport's (then no request)
  };

  std::shared_ptr<CudaApi> api_;
  int rank_ = 0;
  std::unique_ptr<CudnnAttention> cudnn_;
  bool cudnn_required_ = false;
  StreamHandle streams_[kStreams + 1] = {};  // compute, comm, free
  EventHandle free_events_[kStreams] = {};
  std::map<uintptr_t, Storage*> live_;  // by start address (adopted ranges too)
  std::vector<std::unique_ptr<Storage>> adopted_;
  void release_adopted();
  std::deque<PendingReceive> receives_[kStreams];
  std::vector<Request> sends_;  // staged sends, completed at synchronize()
  std::vector<Buffer> keep_;    // host copies a copy may still read
  std::vector<std::pair<EventHandle, EventHandle>> timings_;
  std::map<uint64_t, EventHandle> events_[kStreams];  // record()'s, by number, until synchronize
  uint64_t recorded_[kStreams] = {};
  int64_t cudnn_blocks_ = 0, cudnn_calls_ = 0, fallback_blocks_ = 0, cudnn_refused_ = 0;
};

}  // namespace ctxpar::cuda
