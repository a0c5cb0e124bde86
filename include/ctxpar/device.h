// Devices: where a strategy's memory lives and its kernel operations and transfers run.
// One interface, one file per device (src/device/cpu.cc, src/device/sim.cc, src/cuda). A
// strategy is written once against it: it allocates buffers, *enqueues* kernel operations
// and transfers on streams, and says which stream waits for which (record / wait). See
// docs/device.md (with a diagram).
//
//   cpu:  every operation runs inline on the calling thread; a transfer (send, recv, and the
//         messages of an alltoall) is posted when it is enqueued and a wait blocks the host
//         until it is done, so a transfer posted before a compute overlaps it.
//   sim:  an asynchronous device simulated on the host, for CI: each stream is a FIFO queue run
//         by its own worker thread, events are counters, every operation may be delayed by a
//         seeded random amount, freed memory is filled with NaN, and an operation that uses a
//         buffer another stream writes (or writes one it reads) with no wait in between is
//         refused with an error naming both operations.
//   Both are HostDevices (src/device/host_device.h): the kernel operations are written once,
//   as host work handed to one virtual that cpu calls inline and sim queues.
//   cuda: on a GPU through the CUDA runtime, or in tests over a recording CUDA API on the host
//         (src/cuda/cuda_device.h, docs/cuda.md).
//
// Rules for the code that enqueues (every device relies on them):
//   - An operation reads and writes its views when it runs, not when it is enqueued: keep
//     what they point to alive and unchanged until it is done. Freeing a DeviceBuffer is
//     stream-ordered (cudaFreeAsync): the memory goes back once every operation enqueued so
//     far on any stream is done, so RAII is always safe for DeviceBuffers. Memory that is not
//     a DeviceBuffer (the caller's tensors, Tokens spans) must outlive the call's
//     synchronize().
//   - A buffer written on one stream is read on another only after wait(reader, record(writer)).
//   - A received buffer's address is known when recv() returns; its contents after a wait.
//   - The host touches a communicator itself (a blocking collective) only right after
//     synchronize(), so that no transfer of a stream uses it at the same time.
//   - One host thread (its rank's) makes every call on a device.
//
// What a device provides (the contract a new one, e.g. cuda, is built against):
//   - Memory. alloc(n) returns DeviceBuffer(this, storage) with storage->size == n (the base
//     class counts held / peak bytes from it; a device does not count) and contents left
//     uninitialised. Storage::data() is the address that views over the buffer carry.
//     free(storage) is called when a DeviceBuffer goes; it releases the memory only once every
//     operation enqueued so far, on every stream, is done; it never throws, and never hangs
//     on a failed peer. upload() is optional (default: a host memcpy, for host memory).
//   - Order. Operations of one stream (kernel operations, transfers, waits) run in the order
//     enqueued; anything else may run asynchronously, at any time after its call returns.
//     record(s) returns an Event done once everything enqueued on s before it is done
//     (Event{} is always done, and so is every event once synchronize() returned).
//     wait(s, e): the operations enqueued on s later start after e is done (it may block the
//     host, as cpu's does, but need not). synchronize(): the host waits until every stream's
//     work (transfers included) is done.
//   - Kernel operations: run(s, op), one Op (device_op.h) whose arguments are taken by value
//     (views, Tokens spans, Mask, config: the caller may drop those objects at once, not the
//     memory they point to); a device has one case per argument struct. Views point into DeviceBuffers or the caller's memory; Tokens spans into
//     the caller's host memory or into a DeviceBuffer (a travelling K/V block's positions); a
//     device that cannot read one where it lies copies it itself. Results are bitwise those of
//     kernel.h's functions on the same data, or within the accuracy tests' rule against the
//     fp64 reference for a device with other kernels.
//   - Transfers: send, recv, alltoall, barrier as each one's comment says, through `comm`'s
//     isend / irecv / barrier (so bytes are counted by the communicator); one that is not done
//     after comm.timeout() fails, naming the peer.
//   - Counters (counters_, read after synchronize()): flops, the sum of KernelStats::flops of
//     forward_block and backward_block; busy_seconds, the time of forward_block,
//     forward_finalize, backward_delta and backward_block; wait_seconds, host time blocked
//     waiting for the device or for transfers.
//   - Optional members, defaulted: upload, host_readable, caps() (what the device can do:
//     asked for instead of its name), adopt (the caller's device memory used in place).
//   - Errors: a failed operation or transfer throws ctxpar::Error, from the call that enqueued
//     it, from a later wait(), or at the latest from the next synchronize() (an asynchronous
//     device names the operation and stream in it). After an error a device may drop its queued work (sim does, and then
//     throws again from every synchronize()); the caller only unwinds, so synchronize(),
//     free() and the destructor must not hang on it, and free() and the destructor never throw.
#pragma once
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "ctxpar/comm.h"
#include "ctxpar/device_op.h"
#include "ctxpar/kernel.h"
#include "ctxpar/tensor.h"

namespace ctxpar {

class Device;

// A stream: operations enqueued on one stream run in order. Every device has these two.
struct Stream {
  int index = 0;
  bool operator==(const Stream&) const = default;
};
inline constexpr Stream kComputeStream{0};
inline constexpr Stream kCommStream{1};
inline constexpr int kStreams = 2;
const char* stream_name(Stream s);

// A point in a stream's order: done when every operation enqueued on `stream` before
// record() returned it is done.
struct Event {
  int stream = -1;   // -1: an event that is always done
  uint64_t seq = 0;  // the stream's operation count at record()
};

// Device memory, freed (stream-ordered, see above) when the handle is destroyed or reset.
// Host-addressable on cpu and sim, so TensorViews over it are ordinary views.
class DeviceBuffer {
 public:
  struct Storage;  // the device's own record of the memory
  DeviceBuffer() = default;
  DeviceBuffer(Device* device, std::unique_ptr<Storage> storage);
  DeviceBuffer(DeviceBuffer&&) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&&) noexcept;
  ~DeviceBuffer();
  void reset();
  bool empty() const { return storage_ == nullptr; }
  size_t size() const;
  std::byte* data() const;
  // A contiguous view of `shape` at byte `offset`.
  TensorView view(DType dtype, const Shape& shape, size_t offset = 0) const;
  Storage* storage() const { return storage_.get(); }

 private:
  Device* device_ = nullptr;
  std::unique_ptr<Storage> storage_;
};

// The online-softmax state of one Q block [B, Tq, Hq, D] in device memory: one DeviceBuffer
// holding acc [B, Tq, Hq, D], then m and l [B, Hq, Tq] (fp32, ForwardState's layout), reset
// (m = -inf, l = 0, acc = 0) by a forward_reset enqueued on `s` at construction. get() is the
// views that forward_block / forward_finalize take.
class DeviceForwardState {
 public:
  DeviceForwardState(Device& device, int64_t batch, int64_t tq, int64_t hq, int64_t d,
                     Stream s = kComputeStream);
  const ForwardStateView& get() const { return view_; }

 private:
  DeviceBuffer memory_;
  ForwardStateView view_;
};

// What a device has done since it was made: kernel work and host time blocked in waits.
struct DeviceCounters {
  double flops = 0;         // KernelStats::flops of the attention blocks run
  double busy_seconds = 0;  // time inside the attention operations (forward_*, backward_*)
  double wait_seconds = 0;  // host time blocked waiting (cpu: transfers; sim: in synchronize)
};

// cuda: on this machine's GPU; where there is none, make_device says why (docs/cuda.md).
enum class DeviceKind { cpu, sim, cuda };
inline constexpr int kDeviceKinds = 3;
const char* device_name(DeviceKind k);
DeviceKind parse_device(const std::string& name);  // throws listing the valid names

class DeviceRegistry;
struct DeviceOptions {
  DeviceKind kind = DeviceKind::cpu;
  uint64_t sim_seed = 1;       // sim: seeds the random delay of every operation
  int sim_max_delay_us = 200;  // sim: each operation waits 0..this many microseconds first
  int cuda_index = -1;         // cuda: the GPU; -1: LOCAL_RANK when set, else rank % GPUs
  // Where the device of `kind` comes from; null: DeviceRegistry::builtin().
  std::shared_ptr<const DeviceRegistry> registry;
};

// The device of one rank (each rank has its own: a sim device has its own worker threads),
// made by options.registry's factory for options.kind.
std::unique_ptr<Device> make_device(const DeviceOptions& options, int rank);

// How a device of one kind is made for one rank.
using DeviceFactory = std::function<std::unique_ptr<Device>(const DeviceOptions&, int rank)>;

// The factories of the device kinds (ggml's backend registry, small). builtin() makes cpu, sim
// and cuda (on this machine's GPU). A caller that wants other devices of a kind (a test: cuda
// devices over the recording CUDA API) makes a registry with(kind, its factory) and hands it in
// DeviceOptions::registry: nothing process-wide changes, and only the calls given it see it.
class DeviceRegistry {
 public:
  static const std::shared_ptr<const DeviceRegistry>& builtin();
  // A copy of this registry whose `kind` is made by `factory`.
  std::shared_ptr<const DeviceRegistry> with(DeviceKind kind, DeviceFactory factory) const;
  std::unique_ptr<Device> make(const DeviceOptions& options, int rank) const;

 private:
  DeviceFactory factories_[kDeviceKinds];
};

// What a device can do, for the code that would otherwise ask for its name.
struct DeviceCaps {
  // The host reads a call's inputs to refuse NaN / Inf naming the element (the kernel's checks,
  // the KV cache's door). False where the device reads no input data on the host (cuda: its
  // kernels do not check finiteness, docs/cuda.md).
  bool finite_checks = true;
  // op::Forward runs here (attention_forward of kernel.h: one block's O and LSE without a
  // state); else a caller absorbs the block into a state and finalizes it (forward_whole below
  // chooses).
  bool whole_forward = false;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual std::string name() const = 0;

  // ---- memory -------------------------------------------------------------------------
  // Uninitialised contents (NaN-filled on sim); zero it with fill_zero where needed.
  virtual DeviceBuffer alloc(size_t bytes) = 0;
  // A buffer holding a copy of host memory, made now (the host copy may go right after).
  // Optional: the default copies on the host (memory the host can address).
  virtual DeviceBuffer upload(const void* host, size_t bytes);
  // Bytes of DeviceBuffers (forward states included) held now, and the most held since
  // reset_peak().
  size_t held_bytes() const { return held_; }
  size_t peak_bytes() const { return peak_; }
  void reset_peak() { peak_ = held_; }

  // ---- order --------------------------------------------------------------------------
  virtual Event record(Stream s) = 0;
  virtual void wait(Stream s, const Event& e) = 0;  // later ops on s run after e is done
  virtual void synchronize() = 0;  // the host waits for every stream; rethrows their errors

  // ---- transfers (point-to-point messages of `comm`, enqueued like operations) ----------
  // Sends `buffer` to `peer` once the earlier operations of `s` are done; `buffer` stays
  // readable by the sender (keep the handle until its readers are done), whatever the
  // receiver does with its copy meanwhile (frees it, or unwinds from a failed peer).
  virtual void send(Stream s, Communicator& comm, DeviceBuffer& buffer, int peer, int tag) = 0;
  // A buffer of `bytes` that the message from `peer` fills; read it after a wait on `s`.
  virtual DeviceBuffer recv(Stream s, Communicator& comm, size_t bytes, int peer, int tag) = 0;
  // All-to-all of `comm` on `s`: send holds comm.size() chunks of `chunk_bytes`, chunk j for
  // rank j; recv chunk i comes from rank i (raw bytes). Asynchronous like send / recv: the
  // P-1 chunks go as point-to-point messages of `comm` with tag `tag` (counted as send and
  // recv, same bytes as Communicator::alltoall), `send` may be reused once they are posted
  // (after a wait on `s` to be portable), and recv's contents are there after a wait on `s`.
  // Several may be pending at once, and other messages of `comm` too: each pending one needs
  // its own tag, not used by any other message of `comm` meanwhile (Ulysses: 1<<19 + ...).
  virtual void alltoall(Stream s, Communicator& comm, const DeviceBuffer& send,
                        const DeviceBuffer& recv, size_t chunk_bytes, int tag) = 0;
  virtual void barrier(Stream s, Communicator& comm) = 0;
  // True when a sent buffer's memory itself goes to the receiver (threads transport on the
  // cpu device): sender and receiver then share it (reference-counted, freed by the last).
  virtual bool lends_sent_buffers(const Communicator& comm) const = 0;
  // Whether the host may read the caller's memory at p directly (the strategies' checks of
  // arguments and results do); false for device memory the device was handed in place (the
  // cuda device's adopted CUDA tensors): the checks then read a copy the device makes.
  virtual bool host_readable(const void* p) const { return true; }

  // ---- capabilities and optional members (asked for, never inferred from name()) ----------
  virtual DeviceCaps caps() const { return {}; }
  // The caller's device memory [p, p + bytes) (a CUDA tensor handed in through DLPack), used in
  // place until the device ends, never freed by it. False (and nothing done) where the device
  // cannot (the default): the caller then hands it host memory instead.
  virtual bool adopt(void* p, size_t bytes) { return false; }

  // ---- kernel operations: ops as data (device_op.h; kernel.h for shapes) -----------------
  // Enqueues `op` on s: the one virtual of the kernel operations. The helpers below build the
  // op from the arguments and call it.
  virtual void run(Stream s, const Op& op) = 0;
  void forward_reset(Stream s, const ForwardStateView& state) { run(s, {op::ForwardReset{state}}); }
  void forward_block(Stream s, const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const ForwardStateView& state, const KernelConfig& config) {
    run(s, {op::ForwardBlock{q, q_tokens, k, v, k_tokens, mask, state, config}});
  }
  void forward_finalize(Stream s, const ForwardStateView& state, const TensorView& out,
                        const TensorView& lse, const KernelConfig& config) {
    run(s, {op::ForwardFinalize{state, out, lse, config}});
  }
  // The forward of q against the one K/V block it sees, into out and lse: op::Forward where
  // caps().whole_forward, else a fresh state in device memory, the block and its finalize (the
  // same bits either way).
  void forward_whole(Stream s, const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                     const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                     const TensorView& out, const TensorView& lse, const KernelConfig& config);
  void backward_delta(Stream s, const TensorView& out, const TensorView& dout,
                      const TensorView& delta, const KernelConfig& config) {
    run(s, {op::BackwardDelta{out, dout, delta, config}});
  }
  void backward_block(Stream s, const TensorView& q, const Tokens& q_tokens, const TensorView& k,
                      const TensorView& v, const Tokens& k_tokens, const Mask& mask,
                      const TensorView& dout, const TensorView& lse, const TensorView& delta,
                      const TensorView& dq, const TensorView& dk, const TensorView& dv,
                      const KernelConfig& config) {
    run(s, {op::BackwardBlock{q, q_tokens, k, v, k_tokens, mask, dout, lse, delta, dq, dk, dv,
                              config}});
  }
  // Inference's pass-Q prefill merges the partials that come home in rank order
  // (src/inference/prefill.cc).
  void merge(Stream s, const TensorView& o_a, const TensorView& lse_a, const TensorView& o_b,
             const TensorView& lse_b) {
    run(s, {op::Merge{o_a, lse_a, o_b, lse_b}});
  }
  void add(Stream s, const TensorView& x, const TensorView& y) { run(s, {op::Add{x, y}}); }
  void copy(Stream s, const TensorView& src, const TensorView& dst) {
    run(s, {op::Copy{src, dst}});
  }
  void fill_zero(Stream s, const TensorView& t) { run(s, {op::FillZero{t}}); }
  void pack_kv(Stream s, const TensorView& k, const TensorView& v, const Tokens& tokens,
               bool documents, const TensorView& block_k, const TensorView& block_v,
               std::byte* block_tokens) {
    run(s, {op::PackKv{k, v, tokens, documents, block_k, block_v, block_tokens}});
  }
  void scatter_tokens(Stream s, const TensorView& src, const TensorView& dst,
                      const TensorView& index) {
    run(s, {op::ScatterTokens{src, dst, index}});
  }
  void gather_tokens(Stream s, const TensorView& src, const TensorView& dst,
                     const TensorView& index) {
    run(s, {op::GatherTokens{src, dst, index}});
  }

  DeviceCounters counters() const { return counters_; }

 protected:
  friend class DeviceBuffer;
  // Called by ~DeviceBuffer / reset: the device frees the storage stream-ordered.
  virtual void free(std::unique_ptr<DeviceBuffer::Storage> storage) = 0;
  void hold(size_t bytes) {
    held_ += bytes;
    if (held_ > peak_) peak_ = held_;
  }
  void unhold(size_t bytes) { held_ -= bytes < held_ ? bytes : held_; }
  DeviceCounters counters_;

 private:
  size_t held_ = 0, peak_ = 0;
};

// The storage behind a DeviceBuffer. Devices may keep more in a subclass.
struct DeviceBuffer::Storage {
  virtual ~Storage() = default;
  virtual std::byte* data() = 0;  // cpu: completes a pending receive first
  size_t size = 0;
};

}  // namespace ctxpar
